#!/usr/bin/env python3
"""The curves of bench/slow_links_quality.sh: held-out loss against optimizer step for each
mode, as docs/slow-links-quality.png, and the table of final held-out losses (markdown, on
stdout) with each mode's ratio to the exact hybrid run of the same invocation.

    python3 scripts/plot_slow_links.py OUT_DIR MODE... [--png PATH]
"""
import json
import os
import sys

LABELS = {
    "exact": "exact hybrid (f32 wire)",
    "int8": "int8 codes + error feedback",
    "int4": "4-bit codes + error feedback",
    "diloco8": "outer steps, H = 8",
    "diloco32": "outer steps, H = 32",
    "diloco8bf16": "outer steps, H = 8, bf16 wire",
    "diloco8int8": "outer steps, H = 8, int8 codes + error feedback",
    "diloco8m5": "outer steps, H = 8, outer momentum 0.5",
    "diloco32m5": "outer steps, H = 32, outer momentum 0.5",
    "diloco8int8m5": "outer steps, H = 8, int8 codes, outer momentum 0.5",
    "diloco8avg": "outer steps, H = 8, plain averaging (lr 1, momentum 0)",
    "diloco8stream": "streaming outer steps, H = 8, outer momentum 0.5",
    "diloco8stream256k": "streaming outer steps, H = 8, outer momentum 0.5, 256 KiB buckets",
    "diloco8int8stream256k": "streaming outer steps, H = 8, int8 codes, outer momentum 0.5, "
                             "256 KiB buckets",
}


def main(argv):
    png = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs",
                       "slow-links-quality.png")
    if "--png" in argv:
        i = argv.index("--png")
        png = argv[i + 1]
        del argv[i:i + 2]
    out, modes = argv[0], argv[1:]
    runs = {m: json.load(open(os.path.join(out, m + ".json"))) for m in modes}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, (m, r) in enumerate(runs.items()):
        steps, losses = zip(*r["evals"])
        # exact and codes solid; outer steps with DiLoCo's momentum 0.9 dashed, others dotted
        style = ("-" if not m.startswith("diloco") else
                 "--" if m[-2:] not in ("m5", "vg", "am", "6k") else ":")
        ax.plot(steps, losses, marker=".", linestyle=style, color="C%d" % (i % 10),
                label=LABELS.get(m, m))
    a = runs[modes[0]]["args"]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (nats/char)")
    ax.set_title("train_lm.py, 2 nodes x 2 ranks, %d steps, d=%d, %d layers"
                 % (a["steps"], a["d"], a["layers"]))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    base = runs["exact"]["evals"][-1][1] if "exact" in runs else None
    print("| mode | final held-out loss | vs exact |")
    print("|---|---|---|")
    for m, r in runs.items():
        last = r["evals"][-1][1]
        rel = "%+.2f%%" % (100 * (last / base - 1)) if base else "-"
        print("| %s | %.4f | %s |" % (LABELS.get(m, m), last, rel))
    print("(curves: %s)" % os.path.relpath(png))


if __name__ == "__main__":
    main(sys.argv[1:])
