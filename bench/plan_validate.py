"""Predicted against measured steps (bench/plan_validate.sh writes the inputs): every measured
shardgrad row is predicted by sg_estimate_step from the probe of its link rate and the
forward + backward time the model alone took at the same micro-batch count.

    python bench/plan_validate.py --results OUT/results.txt --probes OUT [--plot PNG]
"""
import argparse
import json
import os
import statistics
import sys

from shardgrad import plan


def parse(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            d = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            rows.append(d)
    return rows


def predict(row, hw, compute_s, numels, bucket_mb):
    hw.compute_s = compute_s
    kw = dict(strategy="shard_grad_op", bucket_bytes=int(bucket_mb * (1 << 20)))
    if row["variant"].startswith("hybrid"):
        kw.update(shard_ranks=hw.ranks_per_node, replica_reduce_dtype=row["wire"])
    world = hw.nodes * hw.ranks_per_node
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
        meas = float(r["step_ms"]) / 1e3
        out.append(dict(rate=r["rate"], micro=int(r["micro"]), variant=r["variant"],
                        load=float(r["load"]), measured_s=meas, predicted_s=e["step_s"],
                        error=(e["step_s"] - meas) / meas, compute_s=e["compute_s"],
                        exposed_net_s=e["exposed_net_s"], exposed_node_s=e["exposed_node_s"],
                        optim_s=e["optim_s"], handover_s=e["handover_s"],
                        net_mbps=hw.net_bytes_per_s * 8 / 1e6,
                        link_mb_measured=float(r.get("link_sent_max_node", -1)) / 1e6,
                        link_mb_predicted=e["link_net_bytes"] / 1e6))
    return out


def show(out):
    print("| link | probed Mbit/s | micro | variant | load | measured s | predicted s | error "
          "| compute | hand-over | x-node exposed | in-node exposed | optim "
          "| node link MB meas./pred. |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for d in out:
        print("| %s | %.0f | %d | %s | %.1f | %.3f | %.3f | %+.0f%% | %.3f | %.3f | %.3f | %.3f "
              "| %.3f | %.1f / %.1f |" % (d["rate"], d["net_mbps"], d["micro"],
                                   d["variant"].replace("_", " "), d["load"], d["measured_s"],
                                   d["predicted_s"], 100 * d["error"], d["compute_s"],
                                   d["handover_s"], d["exposed_net_s"], d["exposed_node_s"],
                                   d["optim_s"],
                                   d["link_mb_measured"], d["link_mb_predicted"]))
    errs = [abs(d["error"]) for d in out]
    if errs:
        print("\n%d rows: median absolute error %.0f%%, largest %.0f%%"
              % (len(errs), 100 * statistics.median(errs), 100 * max(errs)))


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 5))
    marks = {"flat": "o", "hybrid_f32": "s", "hybrid_bf16": "^"}
    for v, m in marks.items():
        pts = [d for d in out if d["variant"] == v]
        ax.scatter([d["measured_s"] for d in pts], [d["predicted_s"] for d in pts], marker=m,
                   label=v.replace("_", " "))
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
    ax.legend(fontsize=8)
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
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    if a.plot and out:
        plot(out, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
