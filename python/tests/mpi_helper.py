"""Run by test_torch.py under `mpirun -np 2`: ShardedAdamW over Comm.mpi() on each rank's part
of the batch for 20 steps; every rank also runs the single-process torch reference on the
combined batch and writes its comparison to <out>.<rank>.json.

usage: mpi_helper.py OUT STRATEGY MICRO NO_SYNC(0|1) MAX_GRAD_NORM
"""

import copy
import hashlib
import json
import sys

import torch

import shardgrad as sg
from shardgrad.torch import ShardedAdamW
from sg_models import make_batches, make_model, max_param_diff, torch_reference, train_sharded


def main():
    out, strategy, micro, no_sync, clip = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        sys.argv[4] == "1", float(sys.argv[5])
    torch.set_num_threads(1)
    comm = sg.Comm.mpi()
    rank, world = comm.rank, comm.size
    base = make_model(0)
    batches = make_batches(1, 20, micro, world, 4)
    hp = dict(lr=3e-3, weight_decay=0.1, max_grad_norm=clip)
    model = copy.deepcopy(base)
    opt = ShardedAdamW(model, comm, strategy=strategy, bucket_bytes=8192, timeout_ms=60000, **hp)
    losses, infos = train_sharded(model, opt, batches, rank, use_no_sync=no_sync)
    mem = opt.memory()
    ref, ref_losses, ref_norms, _ = torch_reference(base, batches, **hp)
    diff, scale = max_param_diff(model, ref)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().numpy().tobytes())
    result = dict(rank=rank, world=world, diff=diff, scale=scale, sha=h.hexdigest(),
                  norms=[i.grad_norm for i in infos], ref_norms=ref_norms,
                  first_loss=ref_losses[0], last_loss=ref_losses[-1],
                  shard_numel=mem.shard_numel, numel=mem.numel, total_bytes=mem.total_bytes)
    opt.close()
    comm.close()
    with open("%s.%d.json" % (out, rank), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
