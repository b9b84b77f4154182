"""Run by test_lightning.py under torchrun --nproc_per_node 2 (gloo): Lightning trains a small
MLP with ShardedAdamW (Comm.from_torch) as the LightningModule's optimizer, each rank on its own
batches, with gradient clipping on:
  auto    automatic optimization, Trainer(gradient_clip_val=CLIP) (Lightning's precision
          plugin clips with torch.nn.utils.clip_grad_norm_ over the optimizer's parameters)
  manual  manual optimization: manual_backward, self.clip_gradients(opt, CLIP, "norm"), step
Each rank also records, before every optimizer step, get_total_norm over p.grad (a third-party
reader). Rank 0 computes the reference: torch.optim.AdamW on DDP's gradients (the mean over the
ranks' batches), clipped by torch.nn.utils.clip_grad_norm_, and writes both as JSON.

Lightning runs as a single-device Trainer on each rank (the optimizer reduces; no DDP strategy),
so the launcher's variables are removed from the environment once the process group exists.

usage: lightning_helper.py OUT_JSON auto|manual
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import shardgrad as sg
from shardgrad.torch import ShardedAdamW, ShardGrad

STEPS, CLIP, LR, BATCH = 4, 0.05, 0.05, 4


def _base():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data(world):
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS, world, BATCH, 8, generator=g)


def _loss(net, x):
    return net(x).square().sum()


def _reference(world):
    net = _base()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    norms = []
    for x in _data(world):
        for r in range(world):
            (_loss(net, x[r]) / world).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return norms, [p.detach().reshape(-1).tolist() for p in net.parameters()]


def _module(mode, comm, rank, seen):
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _base()
            self.automatic_optimization = mode == "auto"

        def training_step(self, batch, idx):
            loss = _loss(self.net, batch[0])
            if mode == "auto":
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self._record()
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
            return None

        def on_before_optimizer_step(self, optimizer):
            if mode == "auto":  # before Lightning clips
                self._record()

        def _record(self):
            grads = [p.grad for p in self.parameters()]
            assert all(isinstance(g, ShardGrad) for g in grads), [type(g) for g in grads]
            seen.append(torch.nn.utils.get_total_norm(grads).item())

        def configure_optimizers(self):
            return ShardedAdamW(self, comm, lr=LR, timeout_ms=120000)

    return Net()


def main():
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = sg.Comm.from_torch()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "TORCHELASTIC_RUN_ID", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(k, None)
    import lightning.pytorch as pl
    data = _data(world)[:, rank]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=None)
    seen = []
    model = _module(mode, comm, rank, seen)
    kw = dict(gradient_clip_val=CLIP) if mode == "auto" else {}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kw)
    trainer.fit(model, loader)
    opt = trainer.optimizers[0]
    assert isinstance(opt, ShardedAdamW), type(opt)
    got = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    steps = opt.step_count
    opt.close()
    # Each rank's result goes through a file, not dist.all_gather_object: gloo's worker thread
    # drops the all-gather's tensors (views with Python objects) after wait() returned, and a
    # rank that exits at once aborts ("terminate called without an active exception") when
    # that thread needs the GIL of a finalizing interpreter (a torch race, seen 1 run in 6).
    with open("%s.rank%d" % (out, rank), "w") as f:
        json.dump(dict(seen=seen, params=got, steps=steps), f)
    dist.barrier()  # no tensors: nothing for gloo's thread to release late
    if rank == 0:
        res = []
        for r in range(world):
            with open("%s.rank%d" % (out, r)) as f:
                res.append(json.load(f))
            os.unlink("%s.rank%d" % (out, r))
        ref_norms, ref_params = _reference(world)
        with open(out, "w") as f:
            json.dump(dict(ranks=res, ref_norms=ref_norms, ref_params=ref_params), f)
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
