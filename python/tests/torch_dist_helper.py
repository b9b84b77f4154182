"""A training script written for torch.distributed, run by test_torch_dist.py under torchrun
(env:// rendezvous) or under mpirun (the torch rank from the MPI environment): it makes the
process group itself, gets a shardgrad communicator from it (Comm.from_torch) and trains a
small model with ShardedAdamW for a few steps, using the torch group for the loss all-reduce
beside it, and trains the same model with torch.optim.AdamW under DistributedDataParallel on the
same data. Rank 0 writes a JSON summary: the communicator kind, every step's global loss, whether
the ranks' parameters agree bitwise, and the largest difference from the DDP run's parameters
(TOL: the two sum the ranks' gradients in different orders, a few ulp per step).

With a second argument `dead`, rank 1 exits right after building its optimizer, and rank 0's
next step must fail (CommError: gloo reports the closed connection, or TimeoutError at the
optimizer's timeout_ms) instead of hanging; rank 0 writes the error class, its text and how long
the step took, then closes everything.

With a second argument `hybrid` (4 ranks), the same script trains three ways side by side:
ShardedAdamW over the whole group (flat ZeRO-2), ShardedAdamW(node, replica_comm=replica) with
node, replica = Comm.from_torch().split_nodes(2) (2 nodes x 2 ranks, as a torchrun job on two
machines would lay them out with --nproc_per_node 2), and DDP + torch.optim.AdamW; rank 0 writes
the largest differences between them and the splits by host name (split_nodes(0)).

usage: torch_dist_helper.py OUT_JSON [dead|hybrid]
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import shardgrad as sg
from shardgrad.torch import ShardedAdamW

STEPS = 5
TOL = 2e-6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * 8, 16, generator=g), torch.randn(world * 8, 4, generator=g)


def main():
    out = sys.argv[1]
    if "RANK" not in os.environ:  # mpirun: torch takes the ranks MPI assigned
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = sg.Comm.from_torch()
    assert (comm.rank, comm.size) == (rank, world), (comm.rank, comm.size, rank, world)
    m = model()
    if sys.argv[2:] == ["dead"]:
        return peer_dies(out, comm, m, rank)
    if sys.argv[2:] == ["hybrid"]:
        return hybrid(out, comm, m, rank, world)
    opt = ShardedAdamW(m, comm, lr=1e-2, weight_decay=0.1, timeout_ms=60000)
    ref = torch.nn.parallel.DistributedDataParallel(model())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for s in range(STEPS):
        x, y = batch(0, world)  # one batch, learned over the steps
        part = slice(rank * 8, (rank + 1) * 8)
        loss = torch.nn.functional.mse_loss(m(x[part]), y[part])
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)  # the torch group still works beside shardgrad's communicator
        losses.append(t.item() / world)
        torch.nn.functional.mse_loss(ref(x[part]), y[part]).backward()
        ropt.step()
        ropt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    same = all(torch.equal(everyone[0], e) for e in everyone)
    diff = max((a - b).abs().max().item()
               for a, b in zip(m.parameters(), ref.module.parameters()))
    kind = comm.kind
    opt.close()
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(kind=kind, world=world, losses=losses, ranks_equal=same,
                           max_diff_vs_torch=diff, tol=TOL), f)


def flat_params(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def hybrid(out, comm, m, rank, world):
    node, replica = comm.split_nodes(2)  # ranks {0, 1} and {2, 3}
    by_host = comm.split_nodes(0)  # one machine: one node of every rank
    host_sizes = [c.size for c in by_host]
    for c in by_host:
        c.close()
    hyb = model()
    opts = [ShardedAdamW(m, comm, lr=1e-2, weight_decay=0.1, timeout_ms=60000),
            ShardedAdamW(hyb, node, replica_comm=replica, lr=1e-2, weight_decay=0.1,
                         timeout_ms=60000)]
    ref = torch.nn.parallel.DistributedDataParallel(model())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    x, y = batch(0, world)
    part = slice(rank * 8, (rank + 1) * 8)
    for s in range(STEPS):
        for mod, opt in ((m, opts[0]), (hyb, opts[1])):
            loss = torch.nn.functional.mse_loss(mod(x[part]), y[part])
            loss.backward()
            opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
        torch.nn.functional.mse_loss(ref(x[part]), y[part]).backward()
        ropt.step()
        ropt.zero_grad()
    flat, hy, dd = flat_params(m), flat_params(hyb), flat_params(ref.module)
    everyone = [torch.empty_like(hy) for _ in range(world)]
    dist.all_gather(everyone, hy)
    same = all(torch.equal(everyone[0], e) for e in everyone)
    res = dict(kind=replica.kind, world=world, sizes=[node.size, replica.size],
               host_sizes=host_sizes, losses=losses, ranks_equal=same, tol=TOL,
               hybrid_vs_flat=(hy - flat).abs().max().item(),
               hybrid_vs_torch=(hy - dd).abs().max().item(),
               flat_vs_torch=(flat - dd).abs().max().item())
    for o in opts:
        o.close()
    for c in (comm, node, replica):  # the parent first: its parts were already closed above
        c.close()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)


def peer_dies(out, comm, m, rank):
    opt = ShardedAdamW(m, comm, lr=1e-2, timeout_ms=5000)
    if rank == 1:
        os._exit(0)  # gone without a word: no close, no destroy_process_group
    x, y = batch(0, 1)
    torch.nn.functional.mse_loss(m(x), y).backward()
    t0 = time.monotonic()
    try:
        opt.step()
        err = None
    except sg.ShardgradError as e:
        err = e
    took = time.monotonic() - t0
    opt.close()
    comm.close()
    with open(out, "w") as f:
        json.dump(dict(error=type(err).__name__ if err else None, text=str(err), seconds=took), f)


if __name__ == "__main__":
    main()
