#!/usr/bin/env python3
"""Regenerates the memory tables of README.md and docs/memory.md from sg_estimate_memory.

    python3 scripts/gen_memory_tables.py            # rewrites the tables between the markers
    python3 scripts/gen_memory_tables.py --check    # exit 1 (and a diff) when a file differs
    python3 scripts/gen_memory_tables.py --png docs/memory.png   # the picture (needs matplotlib)

Every number comes from the library itself (through the Python binding), so the documents say
what sg_memory reports. Each file may hold any of the tables (between their markers); every
table must be in at least one of them. The library is found as the binding finds it
(SHARDGRAD_LIBRARY, the package, a build/ of this checkout) or through --library PATH.

Bytes per parameter are the slope of the per-rank total between two model sizes: what grows
with the model, leaving out what does not (the S x B staging buckets of SHARD_GRAD_OP and the
communication scratch). The largest-model table counts everything sg_estimate_memory counts,
staging buckets and scratch included, but no activations, no framework workspace.
"""

import argparse
import difflib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

PARAM = 1 << 22  # elements per parameter of the model the estimates use (4M: 8 per default bucket)
WORLDS = (1, 2, 4, 8)
# GPU memory as nvidia-smi reports it: 24, 40 and 80 GB cards have that many GiB; the 141 GB
# of an H200 are 140 GiB.
GPU_GIB = (24, 40, 80, 140)
GPU_NAME = {140: "141 GB (140 GiB)"}
STRATEGIES = (("no_shard", "`SG_NO_SHARD`"), ("shard_opt", "`SG_SHARD_OPT`"),
              ("shard_grad_op", "`SG_SHARD_GRAD_OP`"))
BEGIN = "<!-- gen_memory_tables.py: %s begin (generated; edit the script, not the table) -->"
END = "<!-- gen_memory_tables.py: %s end -->"


OFFLOAD = dict(device="cuda", offload_optimizer=1)  # the optimizer state in pinned host memory


def estimate(sg, nparams, world, host=False, **cfg):
    m = sg.estimate_memory([PARAM] * nparams, world, **cfg)
    return m.host_bytes if host else m.total_bytes


def bytes_per_param(sg, world, host=False, **cfg):
    small, big = 16, 48
    return ((estimate(sg, big, world, host, **cfg) - estimate(sg, small, world, host, **cfg)) /
            ((big - small) * PARAM))


def largest_model(sg, gib, world, **cfg):
    """Most parameters (in steps of PARAM) whose per-rank device states fit in `gib` GiB."""
    cap = gib << 30
    lo, hi = 0, 1
    while estimate(sg, hi, world, **cfg) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(sg, mid, world, **cfg) <= cap:
            lo = mid
        else:
            hi = mid
    return lo * PARAM


def fmt(x):
    return ("%.3f" % x).rstrip("0").rstrip(".")


def rows_per_param(sg):
    """(strategy label, params, accumulator, [bytes at each W])."""
    out = []
    for pdt, accums in (("bf16", ("f32", "bf16")), ("f32", ("f32",))):
        for acc in accums:
            for s, label in STRATEGIES:
                vals = [bytes_per_param(sg, w, strategy=s, param_dtype=pdt, accum_dtype=acc)
                        for w in WORLDS]
                out.append((label, pdt, acc, vals))
    return out


def table_per_param(sg):
    lines = ["| strategy | params | accumulator | " + " | ".join("W=%d" % w for w in WORLDS) + " |",
             "|---|---|---|" + "---|" * len(WORLDS)]
    for label, pdt, acc, vals in rows_per_param(sg):
        lines.append("| %s | %s | %s | %s |" % (label, pdt, acc, " | ".join(fmt(v) for v in vals)))
    return lines


def table_summary(sg):
    """The README's short table: bf16 parameters, fp32 accumulator, each strategy."""
    lines = ["| bytes per parameter per rank (bf16 params, fp32 accumulator) | " +
             " | ".join("W=%d" % w for w in WORLDS) + " |", "|---|" + "---|" * len(WORLDS)]
    names = {"`SG_NO_SHARD`": "`SG_NO_SHARD` (plain data parallel)",
             "`SG_SHARD_OPT`": "`SG_SHARD_OPT` (ZeRO-1)",
             "`SG_SHARD_GRAD_OP`": "`SG_SHARD_GRAD_OP` (ZeRO-2, the default)"}
    for label, pdt, acc, vals in rows_per_param(sg):
        if pdt == "bf16" and acc == "f32":
            lines.append("| %s | %s |" % (names[label], " | ".join(fmt(v) for v in vals)))
    return lines


def table_offload(sg):
    """Bytes per parameter per rank with offload_optimizer, on the GPU and in host memory (and
    the host's with 8-bit optimizer state: the GPU's is the same)."""
    lines = ["| strategy + offload | params | accumulator | memory | " +
             " | ".join("W=%d" % w for w in WORLDS) + " |",
             "|---|---|---|---|" + "---|" * len(WORLDS)]
    for pdt, acc in (("bf16", "f32"), ("bf16", "bf16"), ("f32", "f32")):
        for s, label in STRATEGIES[1:]:
            for host in (False, True):
                vals = [bytes_per_param(sg, w, host, strategy=s, param_dtype=pdt, accum_dtype=acc,
                                        **OFFLOAD) for w in WORLDS]
                lines.append("| %s | %s | %s | %s | %s |" % (
                    label, pdt, acc, "host (pinned)" if host else "GPU",
                    " | ".join(fmt(v) for v in vals)))
            if (pdt, acc) == ("bf16", "f32"):  # 8-bit AdamW state: the host's moments shrink
                vals = [bytes_per_param(sg, w, True, strategy=s, param_dtype=pdt,
                                        accum_dtype=acc, optim_state_dtype="q8", **OFFLOAD)
                        for w in WORLDS]
                lines.append("| %s | %s | %s | host (pinned), 8-bit state | %s |" % (
                    label, pdt, acc, " | ".join(fmt(v) for v in vals)))
    return lines


def table_fits_offload(sg):
    """Largest model per GPU size and W for SHARD_GRAD_OP without and with offload, and the
    pinned host memory per rank the offloaded one needs."""
    lines = ["| W | " + " | ".join(GPU_NAME.get(g, "%d GiB" % g) for g in GPU_GIB) + " |",
             "|---|" + "---|" * len(GPU_GIB)]
    cfg = dict(strategy="shard_grad_op", param_dtype="bf16")
    for w in WORLDS:
        cells = []
        for g in GPU_GIB:
            plain = largest_model(sg, g, w, **cfg)
            off = largest_model(sg, g, w, **cfg, **OFFLOAD)
            host = estimate(sg, off // PARAM, w, True, **cfg, **OFFLOAD)
            cells.append("%.1fB / %.1fB (host %d GiB)" % (plain / 1e9, off / 1e9,
                                                          -(-host // (1 << 30))))
        lines.append("| %d | %s |" % (w, " | ".join(cells)))
    return lines


def fit_rows():
    rows = [("no_shard", "`SG_NO_SHARD`", 1)]
    for s, label in STRATEGIES[1:]:
        for w in (2, 8):
            rows.append((s, label, w))
    return rows


def table_fit(sg):
    lines = ["| strategy (bf16 params, fp32 accumulator) | ranks | " +
             " | ".join(GPU_NAME.get(g, "%d GiB" % g) for g in GPU_GIB) + " |",
             "|---|---|" + "---|" * len(GPU_GIB)]
    for s, label, w in fit_rows():
        cells = ["%.1fB" % (largest_model(sg, g, w, strategy=s, param_dtype="bf16") / 1e9)
                 for g in GPU_GIB]
        lines.append("| %s | %s | %s |" % (label, "any" if s == "no_shard" else "W=%d" % w,
                                           " | ".join(cells)))
    return lines


def llama2(d, layers, ffn, vocab=32000):
    """Llama-2's tensors in registration order (no biases; untied embedding and head)."""
    layer = [d, d * d, d * d, d * d, d * d, d, ffn * d, ffn * d, d * ffn]
    return [vocab * d] + layer * layers + [d, vocab * d]


LLAMA = (("Llama-2-7B", llama2(4096, 32, 11008)), ("Llama-2-13B", llama2(5120, 40, 13824)))


def gib(x):
    return "%.1f" % (x / (1 << 30))


def table_q8_llama(sg):
    """Per rank for Llama-2 shapes (bf16 params, fp32 master and accumulator, SHARD_GRAD_OP on
    CUDA): fp32 against 8-bit AdamW state, without and with offload."""
    lines = ["| model | W | optimizer state | GPU, no offload | GPU, offload | host (pinned), "
             "offload |", "|---|---|---|---|---|---|"]
    cfg = dict(strategy="shard_grad_op", param_dtype="bf16", device="cuda")
    for name, numels in LLAMA:
        for w in (1, 2, 4):
            for state in ("f32", "q8"):
                plain = sg.estimate_memory(numels, w, optim_state_dtype=state, **cfg)
                off = sg.estimate_memory(numels, w, optim_state_dtype=state, offload_optimizer=1,
                                         **cfg)
                lines.append("| %s (%.2fB) | %d | %s | %s | %s | %s |" % (
                    name, sum(numels) / 1e9, w, "fp32" if state == "f32" else "8-bit",
                    gib(plain.total_bytes), gib(off.total_bytes), gib(off.host_bytes)))
    return lines


TABLES = (("summary", table_summary), ("bytes-per-param", table_per_param),
          ("largest-model", table_fit), ("offload-per-param", table_offload),
          ("offload-fits", table_fits_offload), ("q8-llama", table_q8_llama))
DEFAULT_DOCS = ("README.md", os.path.join("docs", "memory.md"),
                os.path.join("docs", "optim-state-8bit.md"))


def replace_block(text, name, lines, path):
    """text with the table between each pair of `name`'s markers replaced; None when it has
    none."""
    begin, end = BEGIN % name, END % name
    if begin not in text and end not in text:
        return None
    out, pos = [], 0
    while True:
        i = text.find(begin, pos)
        if i < 0:
            break
        j = text.find(end, i)
        if j < 0:
            raise SystemExit("gen_memory_tables: %s: table '%s' has no end marker:\n%s"
                             % (path, name, end))
        out.append(text[pos:i + len(begin)] + "\n" + "\n".join(lines) + "\n")
        pos = j
    if not out:
        raise SystemExit("gen_memory_tables: %s: table '%s' has an end marker but no begin:\n%s"
                         % (path, name, begin))
    return "".join(out) + text[pos:]


def regenerate(sg, texts):
    """{path: new text} for {path: old text}: every table wherever its markers are."""
    new, found = dict(texts), {}
    for name, make in TABLES:
        lines = None
        for path in texts:
            if BEGIN % name in new[path] or END % name in new[path]:
                lines = lines or make(sg)
                new[path] = replace_block(new[path], name, lines, path)
                found.setdefault(name, []).append(path)
    missing = [name for name, _ in TABLES if name not in found]
    if missing:
        raise SystemExit("gen_memory_tables: no file of %s has the markers of table(s) %s, e.g.\n%s"
                         % (", ".join(texts), ", ".join(missing), BEGIN % missing[0]))
    for path in texts:
        if not any(path in paths for paths in found.values()):
            raise SystemExit("gen_memory_tables: %s has no table markers" % path)
    return new


def draw(sg, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("gen_memory_tables: --png needs matplotlib (pip install matplotlib)")
    worlds = [1, 2, 4, 8, 16, 32, 64]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s, label in STRATEGIES:
        ys = [bytes_per_param(sg, w, strategy=s, param_dtype="bf16") for w in worlds]
        a.plot(worlds, ys, marker="o", label=label.strip("`"))
    a.set_xscale("log", base=2)
    a.set_xticks(worlds)
    a.set_xticklabels([str(w) for w in worlds])
    a.set_xlabel("ranks W")
    a.set_ylabel("bytes per parameter, per rank")
    a.set_title("bf16 params, fp32 master, AdamW, fp32 accumulator")
    a.set_ylim(bottom=0)
    a.grid(True, alpha=0.3)
    a.legend()
    rows = fit_rows()
    width = 0.8 / len(rows)
    for k, (s, label, w) in enumerate(rows):
        ys = [largest_model(sg, g, w, strategy=s, param_dtype="bf16") / 1e9 for g in GPU_GIB]
        xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(GPU_GIB))]
        name = label.strip("`") + ("" if s == "no_shard" else " W=%d" % w)
        b.bar(xs, ys, width, label=name)
    b.set_xticks(range(len(GPU_GIB)))
    b.set_xticklabels([GPU_NAME.get(g, "%d GiB" % g) for g in GPU_GIB])
    b.set_ylabel("largest model (billions of parameters)")
    b.set_title("model states only (no activations)")
    b.grid(True, axis="y", alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print("wrote %s" % path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doc", action="append", metavar="FILE",
                    help="a Markdown file with tables to regenerate (repeatable; default: %s)"
                    % " and ".join(DEFAULT_DOCS))
    ap.add_argument("--check", action="store_true",
                    help="do not write: exit 1 with a diff when a file's tables differ")
    ap.add_argument("--png", metavar="FILE", help="also draw the picture to FILE")
    ap.add_argument("--library", metavar="PATH", help="libshardgrad.so to use")
    args = ap.parse_args()
    if args.library:
        os.environ["SHARDGRAD_LIBRARY"] = args.library
    import shardgrad as sg

    paths = args.doc or [os.path.join(ROOT, p) for p in DEFAULT_DOCS]
    old = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            old[path] = f.read()
    new = regenerate(sg, old)
    changed = [p for p in paths if new[p] != old[p]]
    names = ", ".join(os.path.relpath(p, ROOT) for p in paths)
    if args.check:
        for path in changed:
            rel = os.path.relpath(path, ROOT)
            sys.stdout.writelines(difflib.unified_diff(
                old[path].splitlines(True), new[path].splitlines(True), rel, "generated"))
        if changed:
            print("gen_memory_tables: the memory tables of %s differ from sg_estimate_memory "
                  "(%s); run python3 scripts/gen_memory_tables.py"
                  % (", ".join(os.path.relpath(p, ROOT) for p in changed), sg.library_path()))
            return 1
        print("gen_memory_tables: the memory tables of %s match sg_estimate_memory" % names)
    for path in [] if args.check else changed:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new[path])
        print("updated %s" % path)
    if args.png:
        draw(sg, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
