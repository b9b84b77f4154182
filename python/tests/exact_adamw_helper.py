"""Run by test_torch_exact.py in a fresh process (ATEN_CPU_CAPABILITY is read when torch loads):
ShardedAdamW against torch.optim.AdamW (its default CPU path: single-tensor, foreach=False as
torch picks for CPU tensors) for the same Python hyperparameter values, on parameters whose
gradient is given exactly (the loss is linear in them), at W=1 and W=2 (threads; the
reference gets the ranks' mean gradient, which is what the library's reduction gives
bit for bit). After every step it compares exp_avg, exp_avg_sq and the parameters bit for bit
and prints one JSON line per (world, hyperparameter set).

usage: exact_adamw_helper.py STEPS
"""

import json
import sys

import numpy as np
import torch

import shardgrad as sg
from shardgrad.torch import ShardedAdamW

N = 20011  # not a multiple of any vector width: the tails are covered too
SETS = [  # none of these is float32-exact except the first's betas
    dict(lr=1e-3, betas=(0.875, 0.9990234375), eps=1e-8, weight_decay=0.0),
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),  # torch's defaults
    dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
    dict(lr=6e-4, betas=(0.8, 0.98), eps=1e-6, weight_decay=0.05),
    dict(lr=1e-2, betas=(0.95, 0.9999), eps=1e-5, weight_decay=0.3),
]


class Linear(torch.nn.Module):
    """loss = sum(w * c) + sum(b * d): the gradient of w is c exactly, of b is d."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(N))
        self.b = torch.nn.Parameter(torch.randn(5))  # 1-D, decays too (torch's default)

    def forward(self, c, d):
        return (self.w * c).sum() + (self.b * d).sum()


def ulps(a, b):
    ia = a.numpy().view(np.int32).astype(np.int64)
    ib = b.numpy().view(np.int32).astype(np.int64)
    return int(np.abs(ia - ib).max())


def run(world, hp, steps):
    torch.manual_seed(0)
    base = Linear()
    g = torch.Generator().manual_seed(1)
    grads = [[(torch.randn(N, generator=g) * 0.1, torch.randn(5, generator=g))
              for _ in range(world)] for _ in range(steps)]
    ref = Linear()
    ref.load_state_dict(base.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), **hp)
    ref_states = []
    for s in range(steps):
        c = sum(x[0] for x in grads[s]) / world if world > 1 else grads[s][0][0]
        d = sum(x[1] for x in grads[s]) / world if world > 1 else grads[s][0][1]
        ref(c, d).backward()
        ropt.step()
        ropt.zero_grad()
        st = ropt.state[ref.w]
        ref_states.append((ref.w.detach().clone(), ref.b.detach().clone(),
                           st["exp_avg"].clone(), st["exp_avg_sq"].clone()))

    def body(comm):
        m = Linear()
        m.load_state_dict(base.state_dict())
        opt = ShardedAdamW(m, comm, timeout_ms=60000, **hp)
        out = []
        for s in range(steps):
            m(*grads[s][comm.rank]).backward()
            opt.step()
            st = opt.param_state(m.w)  # collective
            out.append((m.w.detach().clone(), m.b.detach().clone(), st["exp_avg"],
                        st["exp_avg_sq"]))
        opt.close()
        return out

    mine = sg.run_threads(world, body)[0]
    res = dict(world=world, hp=hp, m_diff=[], v_diff=[], p_diff=[], p_ulp=0, p_absdiff=0.0)
    for (w, b, m_, v), (rw, rb, rm, rv) in zip(mine, ref_states):
        res["m_diff"].append(int((m_ != rm).sum()))
        res["v_diff"].append(int((v != rv).sum()))
        res["p_diff"].append(int((w != rw).sum()) + int((b != rb).sum()))
        res["p_ulp"] = max(res["p_ulp"], ulps(w, rw), ulps(b, rb))
        res["p_absdiff"] = max(res["p_absdiff"], (w - rw).abs().max().item(),
                               (b - rb).abs().max().item())
    return res


def main():
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    print(json.dumps(dict(capability=torch.backends.cpu.get_cpu_capability(),
                          torch=torch.__version__, numel=N + 5, steps=steps)))
    for world in (1, 2):
        for hp in SETS:
            print(json.dumps(run(world, hp, steps)), flush=True)


if __name__ == "__main__":
    main()
