#!/usr/bin/env python3
"""8-bit optimizer state against fp32 state on real text (docs/optim-state-8bit.md).

    python3 scripts/q8_quality.py run --out DIR [--seeds 0,1,2,3,4,5] [--steps 600]
    python3 scripts/q8_quality.py plot --out DIR   # docs/optim-state-8bit.png and .md's table

`run` trains examples/python/train_lm.py on the first 2 MB of this Python's standard library
sources (held-out: its last 10%) once with fp32 AdamW state and once with
optim_state_dtype=q8 per seed, the same model, data order and schedule, and writes each run's
losses (DIR/<state>_s<seed>.json, train_lm.py --json). `plot` draws the held-out curves and
writes the table of final held-out losses into the document (between its markers).
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATES = (("f32", []), ("q8", ["--opt", "optim_state_dtype=q8"]))
MODEL = ["--ranks", "2", "--d", "128", "--layers", "2", "--seq", "64", "--batch", "8",
         "--stdlib-corpus", "2", "--eval-every", "25"]


def path_of(out, state, seed):
    return os.path.join(out, "%s_s%d.json" % (state, seed))


def run(args):
    os.makedirs(args.out, exist_ok=True)
    script = os.path.join(ROOT, "examples", "python", "train_lm.py")
    for seed in args.seeds:
        for state, extra in STATES:
            cmd = [sys.executable, script] + MODEL + ["--steps", str(args.steps), "--seed",
                                                      str(seed), "--json",
                                                      path_of(args.out, state, seed)] + extra
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def load(out, seeds):
    runs = {}
    for seed in seeds:
        for state, _ in STATES:
            with open(path_of(out, state, seed)) as f:
                runs[(state, seed)] = json.load(f)
    return runs


def table(runs, seeds):
    lines = ["| seed | fp32 state | 8-bit state | difference |", "|---|---|---|---|"]
    for seed in seeds:
        f = runs[("f32", seed)]["evals"][-1][1]
        q = runs[("q8", seed)]["evals"][-1][1]
        lines.append("| %d | %.4f | %.4f | %+.2f%% |" % (seed, f, q, 100 * (q - f) / f))
    if len(seeds) > 1:
        d = [100 * (runs[("q8", s)]["evals"][-1][1] / runs[("f32", s)]["evals"][-1][1] - 1)
             for s in seeds]
        lines.append("| mean | | | %+.2f%% (largest %+.2f%%) |" % (sum(d) / len(d), max(d)))
    return lines


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = load(args.out, args.seeds)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for k, seed in enumerate(args.seeds):
        for state, style in (("f32", "-"), ("q8", "--")):
            ev = runs[(state, seed)]["evals"]
            label = "%s state, seed %d" % ("fp32" if state == "f32" else "8-bit", seed)
            ax.plot([e[0] for e in ev], [e[1] for e in ev], style, color=colors[k % len(colors)],
                    label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss (cross-entropy, nats per character)")
    ax.set_title("AdamW state fp32 vs 8-bit: GPT on Python stdlib text, 2 ranks")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)
    print("wrote %s" % args.png)
    lines = table(runs, args.seeds)
    print("\n".join(lines))
    if args.doc:
        write_table(args.doc, lines)


BEGIN, END = "<!-- q8_quality.py: table begin -->", "<!-- q8_quality.py: table end -->"


def write_table(path, lines):
    """The table between the document's markers (the numbers of these runs, not typed)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SystemExit("q8_quality.py: %s has no table markers (%s ... %s)" % (path, BEGIN, END))
    text = text[:i + len(BEGIN)] + "\n" + "\n".join(lines) + "\n" + text[j:]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print("updated %s" % path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("run", "plot"))
    ap.add_argument("--out", required=True, help="directory of the runs' JSON files")
    ap.add_argument("--seeds", default="0,1,2,3,4,5", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "optim-state-8bit.png"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "optim-state-8bit.md"),
                    help="the document whose table to rewrite ('' for none)")
    args = ap.parse_args()
    run(args) if args.what == "run" else plot(args)


if __name__ == "__main__":
    main()
