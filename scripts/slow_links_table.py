#!/usr/bin/env python3
"""The summary table of docs/slow-links.md from the two measurements it cites: the quality runs'
JSON (bench/slow_links_quality.sh) and the printed table of bench/cluster.sh with the --slow rows
(rates 10gbit and 100mbit, 8 micro-batches). Markdown on stdout.

    python3 scripts/slow_links_table.py QUALITY_DIR CLUSTER_OUTPUT [--rate 100mbit]
"""
import json
import os
import re
import sys

# mode: (label, setting, cluster.sh variant, quality run)
ROWS = [
    ("exact, f32 wire (default)", "`replica_reduce_dtype = SG_F32`", "shardgrad hybrid, f32 wire",
     "exact"),
    ("exact, bf16 wire", "`replica_reduce_dtype = SG_BF16`", "shardgrad hybrid, bf16 wire", None),
    ("int8 codes + error feedback", "`replica_codec = SG_CODEC_INT8`",
     "shardgrad hybrid, int8 codes + feedback", "int8"),
    ("4-bit codes + error feedback", "`replica_codec = SG_CODEC_INT4`",
     "shardgrad hybrid, int4 codes + feedback", "int4"),
    ("outer steps (DiLoCo), H = 8", "`outer_every = 8`", "shardgrad hybrid, outer steps H=8, f32",
     "diloco8"),
    ("outer steps, H = 8, bf16 wire", "`outer_every = 8`, bf16 wire",
     "shardgrad hybrid, outer steps H=8, bf16", "diloco8bf16"),
    ("outer steps, H = 32", "`outer_every = 32`", "shardgrad hybrid, outer steps H=32, f32",
     "diloco32"),
    ("outer steps, H = 8, int8 codes + error feedback", "`outer_every = 8`, `SG_CODEC_INT8`",
     "shardgrad hybrid, outer steps H=8, int8", "diloco8int8"),
]


def cluster_rows(path, rate):
    """variant -> (step ms median, link MB/step, mean ms) at `rate`."""
    out = {}
    for line in open(path):
        if not line.startswith(rate + " "):
            continue
        m = re.match(r"(\S+)\s+(\d+)\s+(.+?)\s+([\d.]+)\s+([\d.]+)x\s+([\d.-]+)\s+([\d.-]+)\s+(\S+)",
                     line.rstrip())
        if m:
            out[m.group(3)] = (float(m.group(4)), float(m.group(6)), float(m.group(8)))
    return out


def main(argv):
    rate = "100mbit"
    if "--rate" in argv:
        i = argv.index("--rate")
        rate = argv[i + 1]
        del argv[i:i + 2]
    qdir, cpath = argv
    cl = cluster_rows(cpath, rate)
    quality = {}
    for _, _, _, q in ROWS:
        f = os.path.join(qdir, "%s.json" % q) if q else None
        if f and os.path.exists(f):
            quality[q] = json.load(open(f))["evals"][-1][1]
    base_bytes = cl[ROWS[0][2]][1]
    base_loss = quality.get("exact")
    print("| mode | setting | link bytes per step | step at %s (mean) | held-out loss |" % rate)
    print("|---|---|---|---|---|")
    for label, setting, variant, q in ROWS:
        if variant not in cl:
            continue
        _, mb, mean = cl[variant]
        b = "%.1f MB" % mb if variant == ROWS[0][2] else "%.3fx" % (mb / base_bytes)
        if q is None or q not in quality:
            loss = "not measured"
        elif q == "exact":
            loss = "%.4f (baseline)" % quality[q]
        else:
            loss = "%.4f (%+.2f%%)" % (quality[q], 100 * (quality[q] / base_loss - 1))
        print("| %s | %s | %s | %.1f s | %s |" % (label, setting, b, mean / 1e3, loss))


if __name__ == "__main__":
    main(sys.argv[1:])
