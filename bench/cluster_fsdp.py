"""PyTorch's hybrid ZeRO-2 on the simulated cluster: the baseline of bench/cluster.sh.

FSDP2 (torch.distributed.fsdp.fully_shard) on a 2-D DeviceMesh (replicate across nodes, shard
inside a node) with reshard_after_forward=False: parameters stay gathered between forward and
backward, gradients are reduce-scattered inside a node and all-reduced across nodes (HSDP,
ZeRO-2 style), on gloo over the CPU. The same MLP as sg_bench_cluster (32 -> hidden x (layers-1)
-> 8, tanh), AdamW, M micro-batches per optimizer step, as a PyTorch user would run it:

  --sync every      nothing disabled: every micro-batch's backward reduce-scatters inside the node
                    and all-reduces across nodes
  --sync last       set_requires_gradient_sync(False) on all but the last micro-batch (no_sync:
                    unsharded gradients accumulate, nothing is sent until the last)
  --sync allreduce-last   set_requires_all_reduce(False) on all but the last micro-batch: the
                    reduce-scatter inside a node every micro-batch, the cross-node all-reduce once

Started one process per rank by mpirun (scripts/cluster.sh run): rank and size from Open MPI's
environment, rendezvous at --master (node 0's host name). Ranks are placed in consecutive
blocks of --ranks-per-node. Prints one RESULT line (key=value), as sg_bench_cluster does; link
bytes from /sys/class/net/IFACE/statistics of each node's first rank (eth0 inside a cluster.sh
node): the sum over nodes and the most one node sent, per timed step.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sync", choices=["every", "last", "allreduce-last"], default="every")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--master", required=True, help="host name or address of rank 0")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--iface", default="eth0")
    a = p.parse_args()
    if min(a.micro, a.steps, a.batch, a.hidden, a.layers, a.ranks_per_node) < 1 or a.warmup < 0:
        p.error("counts must be >= 1 (--warmup >= 0)")
    return a


def mlp(hidden, layers):
    dims = [32] + [hidden] * (layers - 1) + [8]
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods)


def counter(iface, which):
    try:
        with open(f"/sys/class/net/{iface}/statistics/{which}") as f:
            return int(f.read())
    except OSError:
        return -1


def read_link(iface, leader):
    return counter(iface, "tx_bytes") if leader else 0


def link_totals(start, end):
    """Bytes sent since start by each node's first rank: (sum, max) over nodes; -1 if unreadable."""
    bad = start < 0 or end < 0
    t = torch.tensor([-1 if bad else end - start, 1 if bad else 0], dtype=torch.int64)
    m = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return (-1, -1) if t[1].item() else (t[0].item(), m[0].item())


def main():
    a = parse()
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    k = a.ranks_per_node
    if world % k:
        sys.exit(f"cluster_fsdp: {world} ranks are not a multiple of --ranks-per-node {k}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", a.iface if os.path.exists(
        f"/sys/class/net/{a.iface}") else "lo")
    torch.set_num_threads(1)  # ranks share the cores, as the C ranks do
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}",
                            rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // k, k), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(1)
    model = mlp(a.hidden, a.layers)
    params = sum(p.numel() for p in model.parameters())
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    leader = rank % k == 0
    times, losses, start = [], [], 0
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            start = read_link(a.iface, leader)
        dist.barrier()
        t0 = time.perf_counter()
        total = 0.0
        for mb in range(a.micro):
            last = mb == a.micro - 1
            if a.sync == "last":
                model.set_requires_gradient_sync(last)
            elif a.sync == "allreduce-last":
                model.set_requires_all_reduce(last)
            x = torch.randn(a.batch, 32, generator=gen)
            y = torch.randn(a.batch, 8, generator=gen)
            loss = nn.functional.mse_loss(model(x), y) / a.micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if s >= a.warmup:
            times.append(dt.item())
        losses.append(total)
    total_sent, max_sent = link_totals(start, read_link(a.iface, leader))
    sent = -1 if total_sent < 0 else total_sent / a.steps
    max_node = -1 if max_sent < 0 else max_sent / a.steps
    if rank == 0:
        print(f"RESULT impl=torch-fsdp2-hsdp mode=hybrid sync={a.sync} micro={a.micro} W={world} "
              f"nodes={world // k} params={params} dtype=f32 batch={a.batch} steps={a.steps} "
              f"step_ms={1e3 * statistics.median(times):.1f} link_sent_per_step={sent:.0f} "
              f"link_sent_max_node={max_node:.0f} loss_first={losses[0]:.6f} "
              f"loss_last={losses[-1]:.6f} torch={torch.__version__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
