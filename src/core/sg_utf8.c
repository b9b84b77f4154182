/* UTF-8 validation after RFC 3629, section 4 (the well-formed byte sequences table): the second
 * byte's range depends on the first byte, which is what excludes overlong encodings, the
 * surrogates and code points past U+10FFFF. */
#include "sg_utf8.h"

#include <stdint.h>

/* Length of the well-formed sequence at p (at most `left` bytes available), 0 if there is none. */
static size_t seq_len(const uint8_t *p, size_t left) {
  const uint8_t c = p[0];
  if (c < 0x80) return 1;
  size_t n;
  uint8_t lo = 0x80, hi = 0xBF; /* range of the second byte */
  if (c >= 0xC2 && c <= 0xDF)
    n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0; /* overlong below U+0800 */
    if (c == 0xED) hi = 0x9F; /* surrogates */
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90; /* overlong below U+10000 */
    if (c == 0xF4) hi = 0x8F; /* above U+10FFFF */
  } else
    return 0; /* continuation byte, C0/C1 (overlong ASCII), F5..FF */
  if (left < n || p[1] < lo || p[1] > hi) return 0;
  for (size_t k = 2; k < n; k++)
    if (p[k] < 0x80 || p[k] > 0xBF) return 0;
  return n;
}

size_t sg__utf8_invalid_at(const char *s, size_t n) {
  const uint8_t *p = (const uint8_t *)s;
  size_t i = 0;
  while (i < n) {
    const size_t k = seq_len(p + i, n - i);
    if (k == 0) return i;
    i += k;
  }
  return n;
}
