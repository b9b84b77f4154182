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


def ieee_adamw_step(p, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's _single_tensor_adam (decoupled weight decay, CPU, not capturable),
    operation for operation, with a correctly rounded sqrt: torch's CPU sqrt (MKL's vsSqrt in
    the pip wheel) misrounds a CPU-dependent fraction of its inputs; numpy's float32 sqrt is the
    IEEE operation on every CPU."""
    beta1, beta2 = betas
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    sqrt = torch.from_numpy(np.sqrt(exp_avg_sq.numpy()))
    denom = (sqrt / bias_correction2_sqrt).add_(eps)
    update = torch.addcdiv(torch.zeros_like(p), exp_avg, denom, value=-step_size)
    p.addcdiv_(exp_avg, denom, value=-step_size)
    return update


def spacing(t):
    return torch.from_numpy(np.spacing(np.abs(t.numpy())).astype(np.float64))


def over(a, ref, bnd):
    return int(((a.double() - ref.double()).abs() > bnd).sum())


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
    ieee = [base.w.detach().clone(), base.b.detach().clone()]
    ieee_m = [torch.zeros(N), torch.zeros(5)]
    ieee_v = [torch.zeros(N), torch.zeros(5)]
    ieee_states, bounds = [], []
    bound = [torch.zeros(N, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
    ref_states = []
    for s in range(steps):
        c = sum(x[0] for x in grads[s]) / world if world > 1 else grads[s][0][0]
        d = sum(x[1] for x in grads[s]) / world if world > 1 else grads[s][0][1]
        upd = [ieee_adamw_step(ieee[k], (c, d)[k], ieee_m[k], ieee_v[k], s + 1, **hp)
               for k in range(2)]
        for k in range(2):  # torch_bound's reason, per element and step
            bound[k] += 2.0 ** -22 * upd[k].double().abs() + spacing(ieee[k])
        bounds.append((bound[0].clone(), bound[1].clone()))
        ieee_states.append((ieee[0].clone(), ieee[1].clone()))
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
    res = dict(world=world, hp=hp, m_diff=[], v_diff=[], p_diff=[], p_ulp=0, p_absdiff=[],
               p_ieee_diff=[], p_over_bound=[])
    for (w, b, m_, v), (rw, rb, rm, rv), (iw, ib), (bw, bb) in zip(mine, ref_states,
                                                                  ieee_states, bounds):
        res["m_diff"].append(int((m_ != rm).sum()))
        res["v_diff"].append(int((v != rv).sum()))
        res["p_diff"].append(int((w != rw).sum()) + int((b != rb).sum()))
        res["p_ieee_diff"].append(int((w != iw).sum()) + int((b != ib).sum()))
        res["p_over_bound"].append(over(w, rw, bw) + over(b, rb, bb))
        res["p_ulp"] = max(res["p_ulp"], ulps(w, rw), ulps(b, rb))
        res["p_absdiff"].append(max((w - rw).abs().max().item(), (b - rb).abs().max().item()))
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
