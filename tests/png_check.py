#!/usr/bin/env python3
"""png_check.py FILE MIN_LINE_PIXELS: FILE is a valid PNG as examples/mlp --plot writes it.

Checks the signature, every chunk's CRC-32, IHDR (8-bit palette), PLTE, the zlib stream of the
IDAT chunks (zlib checks the deflate blocks and the Adler-32), one filter byte per scanline, and
that at least MIN_LINE_PIXELS pixels have the loss curve's colour (palette entry 3): the curve
was drawn. Standard library only."""

import struct
import sys
import zlib


def main(path, min_line):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, chunks = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, "bad CRC in chunk %r" % kind
        chunks.append((kind, body))
        pos += 12 + n
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"PLTE" in kinds, kinds
    w, h, depth, ctype = struct.unpack(">IIBB", chunks[0][1][:10])
    assert depth == 8 and ctype == 3, (depth, ctype)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == h * (w + 1), (len(raw), w, h)
    rows = [raw[y * (w + 1):(y + 1) * (w + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows), "a scanline with a filter other than none"
    line = sum(r[1:].count(3) for r in rows)
    assert line >= min_line, "only %d pixels of the curve's colour" % line
    print("%s: %dx%d palette PNG, %d chunks, CRCs and zlib stream ok, %d curve pixels"
          % (path, w, h, len(chunks), line))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
