#!/usr/bin/env python3
"""Writes the AdamW reference trajectories of tests/data/adamw_*.bin from PyTorch.

Each file holds one case: torch.optim.AdamW (single-tensor path, foreach=False, fused=False) on
one fp32 tensor for STEPS steps, with the gradients fed to it and, after every step, torch's
param, exp_avg and exp_avg_sq. tests/test_adamw_ref.c replays the gradients through
sg__cpu_adamw and compares. The tests do not need PyTorch; only this script does.

Hyperparameters are float32 values (passed to torch as the doubles they convert to), so the
float32 config of shardgrad and torch's double scalars describe the same numbers.

CPU kernels: by default torch runs with ATEN_CPU_CAPABILITY=default. On AVX2/AVX-512 builds
torch's vectorized lerp uses a fused multiply-add (vec::fmadd), so exp_avg differs in the last
bit from the unfused expression that DESIGN.md section 5 prescribes and that both shardgrad
backends compute; the "default" kernels evaluate the same expression unfused. The script also
runs the native capability in a subprocess and prints how far it is from the stored numbers.

File layout (little-endian):
  char magic[8] = "SGREF001"; u32 version = 1; u32 numel; u32 steps;
  u32 flags (bit 0: gradients are clipped by clip_coef[t]);
  f32 lr, beta1, beta2, eps, weight_decay, max_norm;
  char note[32] (torch version and CPU capability, NUL padded);
  f32 param0[numel]; f32 clip_coef[steps];
  then per step t = 1..steps: f32 grad[numel] (before clipping), param[numel], exp_avg[numel],
  exp_avg_sq[numel].

Usage: python3 scripts/gen_adamw_ref.py [--out tests/data] [--native]
"""
import argparse
import os
import struct
import subprocess
import sys

MAGIC = b"SGREF001"
VERSION = 1
NUMEL = 100  # not a multiple of the vector width: torch's vector body and scalar tail both run
STEPS = 24


def f32(x):
    import numpy as np
    return float(np.float32(x))


CASES = [
    # name, lr, beta1, beta2, eps, wd, max_norm, grad scale, magnitude spread (decades)
    dict(name="decay", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01, max_norm=0.0,
         gscale=1.0, spread=0),
    # beta1 = 0.5: lerp weight 0.5 takes torch's second form, end - (end - self) * (1 - w)
    dict(name="nodecay", lr=3e-3, beta1=0.5, beta2=0.95, eps=1e-6, wd=0.0, max_norm=0.0,
         gscale=1.0, spread=0),
    dict(name="clip", lr=2e-3, beta1=0.9, beta2=0.99, eps=1e-8, wd=0.1, max_norm=1.0,
         gscale=3.0, spread=0),
    # values and gradients over many decades, lerp weight 0.75, large lr
    dict(name="magnitudes", lr=0.1, beta1=0.25, beta2=0.9, eps=1e-8, wd=0.05, max_norm=0.0,
         gscale=1.0, spread=12),
]


def clip_coef_like_torch(torch, g, max_norm):
    """clip_grad_norm_ for a single tensor: the norm of the stack of per-tensor norms, then
    coef = max_norm / (total + 1e-6) clamped to 1, all as torch computes it (float32 tensors)."""
    norms = [torch.linalg.vector_norm(g, 2.0)]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # the real function must give the same gradient
    g2 = g.clone().requires_grad_(False)
    p = torch.nn.Parameter(torch.zeros_like(g))
    p.grad = g2
    torch.nn.utils.clip_grad_norm_([p], max_norm, foreach=False)
    assert torch.equal(p.grad, g * coef), "clip coefficient does not reproduce clip_grad_norm_"
    return coef


def run_case(torch, c, seed):
    # inputs from numpy: torch's own samplers differ between CPU capabilities
    import numpy as np
    rng = np.random.default_rng(seed)
    n = NUMEL
    lr, b1, b2, eps, wd = (f32(c[k]) for k in ("lr", "beta1", "beta2", "eps", "wd"))
    max_norm = f32(c["max_norm"])

    def spread():
        if not c["spread"]:
            return np.ones(n)
        return 10.0 ** rng.uniform(-c["spread"], c["spread"], n)

    def tensor(x):
        return torch.from_numpy(np.asarray(x, dtype=np.float32).copy())

    p0 = tensor(rng.standard_normal(n) * spread())
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                            foreach=False, fused=False)
    grads, coefs, traj = [], [], []
    for _ in range(STEPS):
        g = tensor(rng.standard_normal(n) * c["gscale"] * spread())
        coef = torch.tensor(1.0)
        gin = g.clone()
        if max_norm > 0:
            coef = clip_coef_like_torch(torch, g, max_norm)
            gin = g * coef
        p.grad = gin
        opt.step()
        st = opt.state[p]
        grads.append(g)
        coefs.append(float(coef))
        traj.append((p.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()))
    hyper = (lr, b1, b2, eps, wd, max_norm)
    return p0, grads, coefs, traj, hyper


def write_case(path, torch, c, p0, grads, coefs, traj, hyper):
    import numpy as np
    note = f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}".encode()[:31]
    flags = 1 if c["max_norm"] > 0 else 0
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<4I", VERSION, NUMEL, STEPS, flags))
        f.write(struct.pack("<6f", *hyper))
        f.write(note.ljust(32, b"\0"))
        f.write(p0.numpy().astype("<f4").tobytes())
        f.write(np.array(coefs, dtype="<f4").tobytes())
        for g, (pp, m, v) in zip(grads, traj):
            for arr in (g, pp, m, v):
                f.write(arr.numpy().astype("<f4").tobytes())


def all_cases(torch):
    return [run_case(torch, c, 1234 + i) for i, c in enumerate(CASES)]


def differences(a, b):
    """(elements not bit-equal, largest |a - b| / max(|a|, |b|)) of two float32 tensors"""
    import numpy as np
    x, y = a.numpy(), b.numpy()
    neq = int(np.sum(x.view(np.int32) != y.view(np.int32)))
    scale = np.maximum(np.abs(x), np.abs(y)).astype(np.float64)
    rel = np.abs(x.astype(np.float64) - y.astype(np.float64)) / np.where(scale > 0, scale, 1.0)
    return neq, float(np.max(rel))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    ap.add_argument("--native", action="store_true", help="keep the native CPU capability")
    ap.add_argument("--compare-stdout", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.native and "ATEN_CPU_CAPABILITY" not in os.environ:
        os.environ["ATEN_CPU_CAPABILITY"] = "default"  # must be set before torch loads
    import torch
    torch.set_num_threads(1)
    results = all_cases(torch)
    if args.compare_stdout:  # child mode: print the final params for the parent to compare
        import numpy as np
        for p0, grads, coefs, traj, hyper in results:
            sys.stdout.write(np.concatenate([t.numpy() for step in traj for t in step]).tobytes().hex() + "\n")
        return
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for c, (p0, grads, coefs, traj, hyper) in zip(CASES, results):
        path = os.path.join(args.out, f"adamw_{c['name']}.bin")
        write_case(path, torch, c, p0, grads, coefs, traj, hyper)
        total += os.path.getsize(path)
        print(f"{path}: {NUMEL} params x {STEPS} steps, capability "
              f"{torch.backends.cpu.get_cpu_capability()}, min clip coef {min(coefs):.4f}")
    print(f"total {total} bytes")
    # how far torch's native (vectorized, FMA) kernels are from the stored numbers
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    out = subprocess.run([sys.executable, __file__, "--native", "--compare-stdout"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    import numpy as np
    for c, (p0, grads, coefs, traj, hyper), hexline in zip(CASES, results, out):
        native = np.frombuffer(bytes.fromhex(hexline), dtype=np.float32).reshape(STEPS, 3, NUMEL)
        line = []
        for k, what in enumerate(("param", "exp_avg", "exp_avg_sq")):
            stored = torch.stack([step[k] for step in traj])
            neq, rel = differences(torch.from_numpy(native[:, k, :].copy()), stored)
            line.append(f"{what} {neq}/{STEPS * NUMEL} differ (max rel {rel:.1e})")
        print(f"  {c['name']}: native capability vs stored: " + ", ".join(line))


if __name__ == "__main__":
    main()
