"""Predicted against measured steps (bench/plan_validate.sh writes the inputs): every measured
shardgrad row is predicted by sg_estimate_step from the probe of its link rate and the
forward + backward time the model alone took at the same micro-batch count. The layout of a
row (flat or hybrid, wire dtype, codec, outer steps) is read from its RESULT fields, so saved
results are predicted again, without measuring, by the model of the library it loads
(SHARDGRAD_LIBRARY):

    python bench/plan_validate.py --results OUT/results.txt --probes OUT [--plot PNG]
"""
import argparse
import json
import os
import statistics
import sys

from shardgrad import plan

CODECS = {"0": None, "1": "int8", "2": "int4"}
# plot markers and labels, in the table's order
VARIANTS = {"flat": ("o", "flat"), "hybrid_f32": ("s", "hybrid f32"),
            "hybrid_bf16": ("^", "hybrid bf16"), "hybrid_int8": ("v", "hybrid int8"),
            "hybrid_int4": ("<", "hybrid int4")}


def parse(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            if d:
                rows.append(d)
    return rows


def label(variant):
    """'outer8_int8' -> 'outer H=8 int8'; the others from VARIANTS."""
    if variant in VARIANTS:
        return VARIANTS[variant][1]
    if variant.startswith("outer"):
        h, _, wire = variant[5:].partition("_")
        return "outer H=%s %s" % (h, wire)
    return variant.replace("_", " ")


def config_of(row, bucket_mb, ranks_per_node):
    """sg_estimate_step's config of a measured row, from its RESULT fields (sg_bench_cluster's
    fill_config: ZeRO-2, f32, the wire, codec and outer steps it ran with)."""
    kw = dict(strategy="shard_grad_op", bucket_bytes=int(bucket_mb * (1 << 20)))
    if row.get("mode", "hybrid" if row["variant"].startswith("hybrid") else "flat") != "hybrid":
        return kw
    kw.update(shard_ranks=ranks_per_node, replica_reduce_dtype=row.get("wire", "f32"))
    codec = CODECS.get(row.get("codec", "0"))
    if codec:
        kw["replica_codec"] = codec
    if int(row.get("outer", 0)):
        kw.update(outer_every=int(row["outer"]), outer_streaming=int(row.get("stream", 0)))
    return kw


def measured_s(row):
    """The step time measured: the median step, or with outer steps the mean over the timed
    steps (a multiple of H: the outer steps' share counted)."""
    key = "step_mean_ms" if int(row.get("outer", 0)) else "step_ms"
    return float(row[key]) / 1e3


def predict(row, hw, compute_s, numels, bucket_mb):
    hw.compute_s = compute_s
    world = hw.nodes * hw.ranks_per_node
    kw = config_of(row, bucket_mb, hw.ranks_per_node)
    return plan.estimate_step(numels, world, int(row["micro"]), hw, **kw)


def table(args):
    rows = parse(args.results)
    numels = plan.mlp_numels(args.hidden, args.layers)
    alone = {(r["rate"], r["micro"]): float(r["step_ms"]) / 1e3 / int(r["micro"])
             for r in rows if r["variant"] == "compute"}
    out = []
    for r in rows:
        if r["variant"] == "compute" or (r["rate"], r["micro"]) not in alone:
            continue
        hw = plan.Hardware.load(os.path.join(args.probes, "probe-%s.json" % r["rate"]))
        e = predict(r, hw, alone[(r["rate"], r["micro"])], numels, args.bucket_mb)
        meas = measured_s(r)
        d = dict(rate=r["rate"], micro=int(r["micro"]), variant=r["variant"],
                 load=float(r["load"]), measured_s=meas, predicted_s=e["step_s"],
                 error=(e["step_s"] - meas) / meas, compute_s=e["compute_s"],
                 exposed_net_s=e["exposed_net_s"], exposed_node_s=e["exposed_node_s"],
                 comm_net_s=e["comm_net_s"], comm_node_s=e["comm_node_s"],
                 optim_s=e["optim_s"], handover_s=e["handover_s"],
                 net_mbps=hw.net_bytes_per_s * 8 / 1e6,
                 link_mb_measured=float(r.get("link_sent_max_node", -1)) / 1e6,
                 # outer steps: the estimate counts the syncing step's bytes; measured is the
                 # mean over the H timed steps
                 link_mb_predicted=e["link_net_bytes"] / 1e6 / max(1, int(r.get("outer", 0))))
        # sg_bench_cluster --profile: where the measured step went (p_NAME_ms=mean/largest
        # over ranks, ms per step) as measured_NAME_s, the mean
        d.update({"measured_%s_s" % k[2:-3]: float(v.split("/")[0]) / 1e3
                  for k, v in r.items() if k.startswith("p_") and k.endswith("_ms")})
        out.append(d)
    return out


def summary(out, what):
    errs = [abs(d["error"]) for d in out]
    if errs:
        print("%s: %d rows: median absolute error %.0f%%, largest %.0f%%"
              % (what, len(errs), 100 * statistics.median(errs), 100 * max(errs)))


def show(out):
    print("| link | probed Mbit/s | micro | variant | load | measured s | predicted s "
          "| error | compute | hand-over | x-node exposed | in-node exposed | optim "
          "| node link MB meas./pred. |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in out:
        cells = ["%s" % d["rate"], "%.0f" % d["net_mbps"],
                 "%d" % d["micro"], label(d["variant"]), "%.1f" % d["load"],
                 "%.3f" % d["measured_s"], "%.3f" % d["predicted_s"],
                 "%+.0f%%" % (100 * d["error"])]
        cells += ["%.3f" % d[k] for k in ("compute_s", "handover_s", "exposed_net_s",
                                          "exposed_node_s", "optim_s")]
        cells.append("%.1f / %.1f" % (d["link_mb_measured"], d["link_mb_predicted"]))
        print("| " + " | ".join(cells) + " |")
    print()
    exact = [d for d in out if d["variant"] in ("flat", "hybrid_f32", "hybrid_bf16")]
    summary(out, "all")
    if len(exact) < len(out):
        summary(exact, "flat and exact hybrid")
        summary([d for d in out if d not in exact], "slow-links modes")


def show_profile(out):
    """With --profile: the comm queue's spans measured (mean over ranks, per step) beside what
    the model put on it: reductions inside the engine's communicator, sums across nodes, gathers
    (spans include waiting for the peers)."""
    rows = [d for d in out if "measured_reduce_scatter_s" in d]
    if not rows:
        return
    print("\n| link | micro | variant | comm predicted in-node / x-node s | measured spans: "
          "reduce-scatter / x-node sums / all-gather s | measured fwd+bwd / sg_step s |")
    print("|---|---|---|---|---|---|")
    for d in rows:
        print("| %s | %d | %s | %.3f / %.3f | %.3f / %.3f / %.3f | %.3f / %.3f |"
              % (d["rate"], d["micro"], label(d["variant"]), d["comm_node_s"], d["comm_net_s"],
                 d["measured_reduce_scatter_s"], d.get("measured_replica_allreduce_s", 0),
                 d.get("measured_all_gather_s", 0), d.get("measured_fwd_bwd_s", 0),
                 d.get("measured_sg_step_s", 0)))


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    outer_marks = iter("DPX*hd")
    for v in dict.fromkeys(d["variant"] for d in out):
        pts = [d for d in out if d["variant"] == v]
        m = VARIANTS[v][0] if v in VARIANTS else next(outer_marks, "x")
        ax.scatter([d["measured_s"] for d in pts], [d["predicted_s"] for d in pts], marker=m,
                   label=label(v))
    hi = max(max(d["measured_s"], d["predicted_s"]) for d in out) * 1.3
    lo = min(min(d["measured_s"], d["predicted_s"]) for d in out) / 1.3
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.plot([lo, hi], [lo * 1.3, hi * 1.3], "k:", lw=0.6, label="+-30%")
    ax.plot([lo, hi], [lo / 1.3, hi / 1.3], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (s)")
    ax.set_ylabel("predicted step (s)")
    ax.set_title("sg_estimate_step on the simulated cluster (2 nodes x 2 ranks)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--results", required=True)
    p.add_argument("--probes", required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--bucket-mb", type=float, default=8)
    p.add_argument("--plot")
    p.add_argument("--json")
    a = p.parse_args()
    out = table(a)
    show(out)
    show_profile(out)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    if a.plot and out:
        plot(out, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
