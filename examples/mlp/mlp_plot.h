/* --plot FILE of examples/mlp: the loss curve of rank 0 and the memory per rank beside
 * NO_SHARD's, drawn into a PNG without any library: an 8-bit palette image, zlib stream of
 * stored (uncompressed) deflate blocks, CRC-32 per chunk, Adler-32 at the end; text in a 5x7
 * bitmap font. Header-only, like mlp_cli.h (tests/mlp.cmake builds mlp.c alone). */
#ifndef MLP_PLOT_H
#define MLP_PLOT_H

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MLP_WHITE, MLP_BLACK, MLP_GRID, MLP_LINE, MLP_GRAY, MLP_TEXT, MLP_BAR, MLP_NCOLORS };
static const unsigned char mlp_palette[MLP_NCOLORS][3] = {
    {255, 255, 255}, {0, 0, 0},    {225, 225, 225}, {31, 119, 180},
    {150, 150, 150}, {60, 60, 60}, {30, 110, 170}};

typedef struct mlp_canvas {
  int w, h;
  unsigned char *px; /* palette index per pixel, row-major */
} mlp_canvas;

/* ---- PNG ------------------------------------------------------------------------------------ */

static inline uint32_t mlp_crc32(uint32_t crc, const unsigned char *p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; i++) {
    crc ^= p[i];
    for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

static inline void mlp_be32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)(v >> 24), p[1] = (unsigned char)(v >> 16);
  p[2] = (unsigned char)(v >> 8), p[3] = (unsigned char)v;
}

/* One chunk: length, type, data, CRC of type and data. */
static inline int mlp_png_chunk(FILE *f, const char *type, const unsigned char *data, size_t n) {
  unsigned char head[8], tail[4];
  mlp_be32(head, (uint32_t)n);
  memcpy(head + 4, type, 4);
  mlp_be32(tail, mlp_crc32(mlp_crc32(0, head + 4, 4), data, n));
  return fwrite(head, 1, 8, f) == 8 && (n == 0 || fwrite(data, 1, n, f) == n) &&
                 fwrite(tail, 1, 4, f) == 4
             ? 0
             : -1;
}

/* The zlib stream of the scanlines (filter byte 0, then the row) in stored blocks. */
static inline unsigned char *mlp_png_zlib(const mlp_canvas *c, size_t *out_n) {
  const size_t raw = (size_t)c->h * (size_t)(c->w + 1), nblocks = raw / 65535 + 1;
  unsigned char *z = malloc(2 + raw + 5 * nblocks + 4), *o = z;
  if (!z) return NULL;
  *o++ = 0x78, *o++ = 0x01; /* deflate, 32K window, no dictionary, check bits */
  uint32_t a = 1, b = 0;    /* Adler-32 */
  size_t done = 0, in_block = 0, block_len = 0;
  unsigned char *len_at = NULL;
  for (int y = 0; y < c->h; y++)
    for (int x = -1; x < c->w; x++) {
      if (in_block == block_len) { /* start the next stored block */
        block_len = raw - done < 65535 ? raw - done : 65535;
        in_block = 0;
        *o++ = done + block_len == raw ? 1 : 0; /* BFINAL, BTYPE 00 */
        len_at = o;
        len_at[0] = (unsigned char)block_len, len_at[1] = (unsigned char)(block_len >> 8);
        len_at[2] = (unsigned char)~block_len, len_at[3] = (unsigned char)(~block_len >> 8);
        o += 4;
      }
      const unsigned char v = x < 0 ? 0 : c->px[(size_t)y * (size_t)c->w + (size_t)x];
      *o++ = v;
      a = (a + v) % 65521u, b = (b + a) % 65521u;
      in_block++, done++;
    }
  mlp_be32(o, (b << 16) | a);
  *out_n = (size_t)(o + 4 - z);
  return z;
}

static inline int mlp_png_write(const char *path, const mlp_canvas *c) {
  static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  unsigned char ihdr[13], plte[3 * MLP_NCOLORS];
  mlp_be32(ihdr, (uint32_t)c->w);
  mlp_be32(ihdr + 4, (uint32_t)c->h);
  ihdr[8] = 8, ihdr[9] = 3, ihdr[10] = 0, ihdr[11] = 0, ihdr[12] = 0; /* 8-bit palette */
  memcpy(plte, mlp_palette, sizeof plte);
  size_t zn = 0;
  unsigned char *z = mlp_png_zlib(c, &zn);
  FILE *f = z ? fopen(path, "wb") : NULL;
  int rc = f && fwrite(sig, 1, 8, f) == 8 && !mlp_png_chunk(f, "IHDR", ihdr, sizeof ihdr) &&
                   !mlp_png_chunk(f, "PLTE", plte, sizeof plte) &&
                   !mlp_png_chunk(f, "IDAT", z, zn) && !mlp_png_chunk(f, "IEND", NULL, 0)
               ? 0
               : -1;
  const int err = errno;
  if (f && fclose(f) != 0) rc = -1;
  free(z);
  errno = rc ? (err ? err : EIO) : 0;
  return rc;
}

/* ---- drawing -------------------------------------------------------------------------------- */

static inline void mlp_put(mlp_canvas *c, int x, int y, int color) {
  if (x >= 0 && y >= 0 && x < c->w && y < c->h) c->px[(size_t)y * (size_t)c->w + (size_t)x] = (unsigned char)color;
}

static inline void mlp_rect(mlp_canvas *c, int x0, int y0, int x1, int y1, int color) {
  for (int y = y0; y <= y1; y++)
    for (int x = x0; x <= x1; x++) mlp_put(c, x, y, color);
}

/* A line two pixels thick (Bresenham, and the pixel below each). */
static inline void mlp_line(mlp_canvas *c, int x0, int y0, int x1, int y1, int color) {
  const int dx = abs(x1 - x0), dy = -abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  for (int err = dx + dy;;) {
    mlp_put(c, x0, y0, color);
    mlp_put(c, x0, y0 + 1, color);
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) err += dy, x0 += sx;
    if (e2 <= dx) err += dx, y0 += sy;
  }
}

/* 5x7 glyphs, one byte per row, bit 4 = leftmost column. */
static inline const unsigned char *mlp_glyph(int ch) {
  static const char chars[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.-_=()/:,%>";
  static const unsigned char g[][7] = {
      {14, 17, 19, 21, 25, 17, 14}, {4, 12, 4, 4, 4, 4, 14},      {14, 17, 1, 2, 4, 8, 31},
      {31, 2, 4, 2, 1, 17, 14},     {2, 6, 10, 18, 31, 2, 2},     {31, 16, 30, 1, 1, 17, 14},
      {6, 8, 16, 30, 17, 17, 14},   {31, 1, 2, 4, 8, 8, 8},       {14, 17, 17, 14, 17, 17, 14},
      {14, 17, 17, 15, 1, 2, 12},   {14, 17, 17, 31, 17, 17, 17}, {30, 17, 17, 30, 17, 17, 30},
      {14, 17, 16, 16, 16, 17, 14}, {28, 18, 17, 17, 17, 18, 28}, {31, 16, 16, 30, 16, 16, 31},
      {31, 16, 16, 30, 16, 16, 16}, {14, 17, 16, 23, 17, 17, 15}, {17, 17, 17, 31, 17, 17, 17},
      {14, 4, 4, 4, 4, 4, 14},      {7, 2, 2, 2, 2, 18, 12},      {17, 18, 20, 24, 20, 18, 17},
      {16, 16, 16, 16, 16, 16, 31}, {17, 27, 21, 21, 17, 17, 17}, {17, 17, 25, 21, 19, 17, 17},
      {14, 17, 17, 17, 17, 17, 14}, {30, 17, 17, 30, 16, 16, 16}, {14, 17, 17, 17, 21, 18, 13},
      {30, 17, 17, 30, 20, 18, 17}, {15, 16, 16, 14, 1, 1, 30},   {31, 4, 4, 4, 4, 4, 4},
      {17, 17, 17, 17, 17, 17, 14}, {17, 17, 17, 17, 17, 10, 4},  {17, 17, 17, 21, 21, 21, 10},
      {17, 17, 10, 4, 10, 17, 17},  {17, 17, 17, 10, 4, 4, 4},    {31, 1, 2, 4, 8, 16, 31},
      {0, 0, 0, 0, 0, 12, 12},      {0, 0, 0, 31, 0, 0, 0},       {0, 0, 0, 0, 0, 0, 31},
      {0, 0, 31, 0, 31, 0, 0},      {2, 4, 8, 8, 8, 4, 2},        {8, 4, 2, 2, 2, 4, 8},
      {0, 1, 2, 4, 8, 16, 0},       {0, 12, 12, 0, 12, 12, 0},    {0, 0, 0, 0, 12, 4, 8},
      {24, 25, 2, 4, 8, 19, 3},     {8, 4, 2, 1, 2, 4, 8}};
  const char *p = ch ? strchr(chars, toupper(ch)) : NULL;
  return p ? g[p - chars] : NULL; /* NULL: a blank (space or a character the font lacks) */
}

/* Text with its top left at (x, y), each font pixel `s` x `s`; returns its width. */
static inline int mlp_text(mlp_canvas *c, int x, int y, int s, int color, const char *str) {
  int x0 = x;
  for (; *str; str++, x += 6 * s) {
    const unsigned char *g = mlp_glyph((unsigned char)*str);
    for (int r = 0; g && r < 7; r++)
      for (int k = 0; k < 5; k++)
        if (g[r] & (16 >> k)) mlp_rect(c, x + k * s, y + r * s, x + k * s + s - 1, y + r * s + s - 1, color);
  }
  return x - x0;
}

static inline int mlp_text_width(const char *str, int s) { return (int)strlen(str) * 6 * s; }

/* ---- the plot ------------------------------------------------------------------------------- */

/* loss[i] is the loss of step first_step + i; mem and ddp are bytes per rank of this run and of
 * NO_SHARD. 0, or -1 with errno set. */
static inline int mlp_plot_write(const char *path, const float *loss, int n, int first_step,
                                 double mem, double ddp, const char *strategy, int world) {
  enum { W = 900, H = 460, L = 80, R = 600, T = 50, B = 400 };
  mlp_canvas c = {W, H, calloc((size_t)W * H, 1)};
  if (!c.px || n < 1) {
    free(c.px);
    errno = c.px ? EINVAL : ENOMEM;
    return -1;
  }
  char buf[96];
  float lo = loss[0], hi = loss[0];
  for (int i = 1; i < n; i++) {
    if (isfinite(loss[i]) && loss[i] < lo) lo = loss[i];
    if (isfinite(loss[i]) && loss[i] > hi) hi = loss[i];
  }
  if (!(hi > lo)) hi = lo + 1.0f;
  const double pad = 0.05 * (hi - lo), ylo = lo - pad, yhi = hi + pad;
  snprintf(buf, sizeof buf, "LOSS OF RANK 0, %s, W=%d", strategy, world);
  mlp_text(&c, L, 14, 2, MLP_TEXT, buf);
  for (int k = 0; k <= 4; k++) { /* y grid and labels */
    const int y = B - (B - T) * k / 4;
    mlp_rect(&c, L, y, R, y, MLP_GRID);
    snprintf(buf, sizeof buf, "%.3g", ylo + (yhi - ylo) * k / 4);
    mlp_text(&c, L - 8 - mlp_text_width(buf, 1), y - 3, 1, MLP_TEXT, buf);
  }
  for (int k = 0; k <= 4; k++) { /* x labels: steps */
    const int x = L + (R - L) * k / 4;
    snprintf(buf, sizeof buf, "%d", first_step + (n > 1 ? (n - 1) * k / 4 : 0));
    mlp_rect(&c, x, B, x, B + 4, MLP_BLACK);
    mlp_text(&c, x - mlp_text_width(buf, 1) / 2, B + 10, 1, MLP_TEXT, buf);
  }
  mlp_text(&c, (L + R) / 2 - mlp_text_width("STEP", 1) / 2, B + 26, 1, MLP_TEXT, "STEP");
  int px = -1, py = -1;
  for (int i = 0; i < n; i++) {
    if (!isfinite(loss[i])) continue;
    const int x = L + (int)lround((double)(R - L) * (n > 1 ? (double)i / (n - 1) : 0.5));
    const int y = B - (int)lround((double)(B - T) * ((double)loss[i] - ylo) / (yhi - ylo));
    if (px >= 0) mlp_line(&c, px, py, x, y, MLP_LINE);
    else mlp_put(&c, x, y, MLP_LINE);
    px = x, py = y;
  }
  mlp_rect(&c, L, T, L, B, MLP_BLACK); /* axes */
  mlp_rect(&c, L, B, R, B, MLP_BLACK);
  /* memory per rank: this run beside NO_SHARD */
  const int bx = 680, bw = 70, gap = 50;
  const double top = mem > ddp ? mem : ddp, mib = 1024.0 * 1024.0;
  mlp_text(&c, bx - 20, 14, 2, MLP_TEXT, "MIB PER RANK");
  const double vals[2] = {mem, ddp};
  const char *names[2] = {strategy, "NO_SHARD"};
  for (int k = 0; k < 2; k++) {
    const int x0 = bx + k * (bw + gap), h = top > 0 ? (int)((B - T - 20) * vals[k] / top) : 0;
    mlp_rect(&c, x0, B - h, x0 + bw, B, k == 0 ? MLP_BAR : MLP_GRAY);
    snprintf(buf, sizeof buf, "%.3g", vals[k] / mib);
    mlp_text(&c, x0 + bw / 2 - mlp_text_width(buf, 1) / 2, B - h - 12, 1, MLP_TEXT, buf);
    mlp_text(&c, x0 + bw / 2 - mlp_text_width(names[k], 1) / 2, B + 10, 1, MLP_TEXT, names[k]);
  }
  mlp_rect(&c, bx - 10, B, bx + 2 * bw + gap + 10, B, MLP_BLACK);
  const int rc = mlp_png_write(path, &c);
  free(c.px);
  return rc;
}

#endif
