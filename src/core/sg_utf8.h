/* UTF-8 validation (RFC 3629): what JSON text, and so safetensors headers, must be. */
#ifndef SG_UTF8_H
#define SG_UTF8_H

#include <stddef.h>

/* Byte offset of the first byte that does not start a well-formed UTF-8 sequence within s[0..n)
 * (overlong forms, surrogates U+D800..U+DFFF, code points above U+10FFFF and truncated
 * sequences are ill-formed); n when all of it is well-formed. */
size_t sg__utf8_invalid_at(const char *s, size_t n);

#endif /* SG_UTF8_H */
