#!/usr/bin/env python3
"""torch.optim.AdamW(fused=True) on CUDA over the sizes of bench/bench_adamw_cuda.cu, in GB/s counted
the same way (28 B/param for f32 params; 30 B/param for bf16 params with an fp32 master, which
torch has no fused form of: its row uses f32 params and says so), so that the two can be put
side by side. Goal of issue 3: sg_bench_adamw_cuda >= 1.2x torch's speed.

torch's fused AdamW steps a list of tensors; one tensor of N parameters is its best case (fewest
launches), so the comparison is fair to torch. Timed with CUDA events after warm-up, median of
reps.

    python3 bench/adamw_torch.py [--sizes 1,4,16,64,256] [--reps 20] [--warmup 3]

Exits 0 with a message (SKIP) when torch or a CUDA device is absent."""
import argparse
import statistics
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16,64,256", help="Mi parameters, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("adamw_torch: SKIP: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print(f"adamw_torch: SKIP: torch {torch.__version__} sees no CUDA device")
        return 0
    sizes = [int(s) << 20 for s in args.sizes.split(",") if s]
    dev = torch.device("cuda")
    print(f"adamw_torch: torch {torch.__version__}, torch.optim.AdamW(fused=True), "
          f"{torch.cuda.get_device_name(0)}, median of {args.reps} after {args.warmup} warm-up")
    print("bytes per param: 28 (f32 params: grad 4 + param r/w 8 + m r/w 8 + v r/w 8)")
    print(f"{'params':>8}  {'param':<5}  {'adamw ms':>9}  {'adamw GB/s':>10}")
    for n in sizes:
        p = torch.nn.Parameter(torch.full((n,), 0.25, device=dev, dtype=torch.float32))
        p.grad = torch.full_like(p, -0.1)
        opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                fused=True)
        for _ in range(args.warmup):
            opt.step()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.reps):
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        print(f"{n >> 20:>7}M  {'f32':<5}  {ms:9.3f}  {28.0 * n / ms / 1e6:10.1f}")
        del opt, p
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
