/* CRC-32C (Castagnoli): the checksum of every checkpoint section chunk, header and manifest.
 * Portable slicing-by-8 (eight 256-entry tables, eight bytes per step), and on x86-64 the
 * SSE4.2 crc32 instruction when the CPU has it; both give the same values. */
#include <pthread.h> /* pthread_once */
#include <string.h>  /* memcpy */

#include "sg_ckpt.h"

#define SG__CRC_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t g_table[8][256];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

/* g_table[0] is the byte-at-a-time table; g_table[k][b] is the CRC of byte b followed by k
 * zero bytes, so eight table lookups advance the CRC by eight bytes. */
static void build_tables(void) {
  for (uint32_t b = 0; b < 256; b++) {
    uint32_t c = b;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (SG__CRC_POLY & (0u - (c & 1u)));
    g_table[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; b++)
    for (int k = 1; k < 8; k++)
      g_table[k][b] = (g_table[k - 1][b] >> 8) ^ g_table[0][g_table[k - 1][b] & 0xffu];
}

static uint64_t load_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

uint32_t sg__crc32c_sw(uint32_t crc, const void *data, size_t n) {
  pthread_once(&g_once, build_tables);
  const uint8_t *p = data;
  uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    const uint64_t x = load_le64(p) ^ c;
    c = g_table[7][x & 0xff] ^ g_table[6][(x >> 8) & 0xff] ^ g_table[5][(x >> 16) & 0xff] ^
        g_table[4][(x >> 24) & 0xff] ^ g_table[3][(x >> 32) & 0xff] ^
        g_table[2][(x >> 40) & 0xff] ^ g_table[1][(x >> 48) & 0xff] ^ g_table[0][x >> 56];
  }
  while (n--) c = (c >> 8) ^ g_table[0][(c ^ *p++) & 0xffu];
  return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const void *data,
                                                          size_t n) {
  const uint8_t *p = data;
  uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t x;
    memcpy(&x, p, 8);
    c = __builtin_ia32_crc32di(c, x);
  }
  uint32_t c32 = (uint32_t)c;
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
}

static int g_have_hw = -1; /* decided once; a benign race writes the same value */

uint32_t sg__crc32c(uint32_t crc, const void *data, size_t n) {
  int hw = __atomic_load_n(&g_have_hw, __ATOMIC_RELAXED);
  if (hw < 0) {
    __builtin_cpu_init();
    hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    __atomic_store_n(&g_have_hw, hw, __ATOMIC_RELAXED);
  }
  return hw ? crc_hw(crc, data, n) : sg__crc32c_sw(crc, data, n);
}
#else
uint32_t sg__crc32c(uint32_t crc, const void *data, size_t n) {
  return sg__crc32c_sw(crc, data, n);
}
#endif
