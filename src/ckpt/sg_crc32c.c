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
        g_table[4][(x >> 24) & 0xff] ^ g_table[3][(x >> 32) & 0xff] ^ g_table[2][(x >> 40) & 0xff] ^
        g_table[1][(x >> 48) & 0xff] ^ g_table[0][x >> 56];
  }
  while (n--) c = (c >> 8) ^ g_table[0][(c ^ *p++) & 0xffu];
  return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* The crc32 instruction has a latency of 3 cycles and a throughput of 1: three independent
 * streams over three consecutive blocks of SG__LANE bytes run three times as fast, and are then
 * joined with the linear map "append SG__LANE zero bytes" (g_shift, table-driven). */
#define SG__LANE 4096

static uint32_t g_shift[4][256];
static pthread_once_t g_shift_once = PTHREAD_ONCE_INIT;

__attribute__((target("sse4.2"))) static uint32_t raw_zeros(uint32_t r, size_t n) {
  uint64_t c = r;
  for (size_t i = 0; i < n / 8; i++) c = __builtin_ia32_crc32di(c, 0);
  return (uint32_t)c;
}

/* g_shift[k][b] = (register b << 8k) advanced over SG__LANE zero bytes; built from the images
 * of the 32 basis vectors, as the map is linear over GF(2). */
static void build_shift(void) {
  uint32_t basis[32];
  for (int i = 0; i < 32; i++) basis[i] = raw_zeros(1u << i, SG__LANE);
  for (int k = 0; k < 4; k++)
    for (uint32_t b = 0; b < 256; b++) {
      uint32_t x = 0;
      for (int i = 0; i < 8; i++)
        if (b & (1u << i)) x ^= basis[8 * k + i];
      g_shift[k][b] = x;
    }
}

static uint32_t shift(uint32_t r) {
  return g_shift[0][r & 0xff] ^ g_shift[1][(r >> 8) & 0xff] ^ g_shift[2][(r >> 16) & 0xff] ^
         g_shift[3][r >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const void *data, size_t n) {
  const uint8_t *p = data;
  uint64_t c = ~crc;
  if (n >= 3 * SG__LANE) pthread_once(&g_shift_once, build_shift);
  for (; n >= 3 * SG__LANE; n -= 3 * SG__LANE, p += 3 * SG__LANE) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < SG__LANE; i += 8) {
      uint64_t a, b, d;
      memcpy(&a, p + i, 8);
      memcpy(&b, p + SG__LANE + i, 8);
      memcpy(&d, p + 2 * SG__LANE + i, 8);
      c = __builtin_ia32_crc32di(c, a);
      c1 = __builtin_ia32_crc32di(c1, b);
      c2 = __builtin_ia32_crc32di(c2, d);
    }
    c = shift(shift((uint32_t)c) ^ (uint32_t)c1) ^ (uint32_t)c2;
  }
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
