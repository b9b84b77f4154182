#!/usr/bin/env python3
"""torch.optim.AdamW as a baseline for the shardgrad AdamW benchmarks, in GB/s counted the same way
(28 B/param for f32 params: grad 4 + param r/w 8 + m r/w 8 + v r/w 8).

CUDA (default): fused=True over the sizes of bench/bench_adamw_cuda.cu (bf16 params with an fp32
master have no fused torch form: the row uses f32 params and says so). Goal of issue 3:
sg_bench_adamw_cuda >= 1.2x torch's speed. Timed with CUDA events after warm-up, median of reps.

CPU (--device cpu): fused=True and foreach=True on CPU tensors, timed with perf_counter.

Serve (--serve N): the CPU baseline driven by another program (bench/bench_host_step.c), so that
torch's steps interleave with its own: prints "ready <torch version> <threads>", then for each
line "fused" or "foreach" on stdin runs one step of that optimizer over N f32 parameters and
prints its milliseconds; "quit" or end of input ends it.

torch's AdamW steps a list of tensors; one tensor of N parameters is its best case (fewest
launches and loops), so the comparison is fair to torch.

    python3 bench/adamw_torch.py [--device cuda|cpu] [--sizes 1,4,16,64,256] [--reps 20]
    python3 bench/adamw_torch.py --serve N [--threads T]

Exits 0 with a message (SKIP) when torch (or for CUDA, a device) is absent."""
import argparse
import statistics
import sys
import time


def make(torch, n, dev, fused):
    p = torch.nn.Parameter(torch.full((n,), 0.25, device=dev, dtype=torch.float32))
    p.grad = torch.full_like(p, -0.1)
    kw = {"fused": True} if fused else {"foreach": True}
    return p, torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                                **kw)


def timed_step(opt):
    t0 = time.perf_counter()
    opt.step()
    return (time.perf_counter() - t0) * 1e3


def serve(torch, n):
    opts = {"fused": make(torch, n, "cpu", True), "foreach": make(torch, n, "cpu", False)}
    for _, opt in opts.values():  # first steps allocate the moments
        opt.step()
    print(f"ready {torch.__version__} {torch.get_num_threads()}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd not in opts:
            print("error unknown command", flush=True)
            continue
        print(f"{timed_step(opts[cmd][1]):.6f}", flush=True)
    return 0


def cpu_table(torch, sizes, reps, warmup):
    print(f"adamw_torch: torch {torch.__version__}, torch.optim.AdamW on CPU tensors, "
          f"{torch.get_num_threads()} thread(s), median of {reps} after {warmup} warm-up")
    print(f"{'params':>8}  {'impl':<8}  {'adamw ms':>9}  {'adamw GB/s':>10}")
    for n in sizes:
        for fused in (True, False):
            p, opt = make(torch, n, "cpu", fused)
            for _ in range(warmup):
                opt.step()
            ms = statistics.median(timed_step(opt) for _ in range(reps))
            name = "fused" if fused else "foreach"
            print(f"{n >> 20:>7}M  {name:<8}  {ms:9.3f}  {28.0 * n / ms / 1e6:10.2f}")
            del opt, p
    return 0


def cuda_table(torch, sizes, reps, warmup):
    if not torch.cuda.is_available():
        print(f"adamw_torch: SKIP: torch {torch.__version__} sees no CUDA device")
        return 0
    dev = torch.device("cuda")
    print(f"adamw_torch: torch {torch.__version__}, torch.optim.AdamW(fused=True), "
          f"{torch.cuda.get_device_name(0)}, median of {reps} after {warmup} warm-up")
    print("bytes per param: 28 (f32 params: grad 4 + param r/w 8 + m r/w 8 + v r/w 8)")
    print(f"{'params':>8}  {'param':<5}  {'adamw ms':>9}  {'adamw GB/s':>10}")
    for n in sizes:
        p, opt = make(torch, n, dev, True)
        for _ in range(warmup):
            opt.step()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sizes", default="1,4,16,64,256", help="Mi parameters, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--serve", type=int, default=0, metavar="N",
                    help="serve steps over N parameters on stdin/stdout (CPU)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("adamw_torch: SKIP: torch is not installed", flush=True)
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.serve > 0:
        return serve(torch, args.serve)
    sizes = [int(s) << 20 for s in args.sizes.split(",") if s]
    if args.device == "cpu":
        return cpu_table(torch, sizes, args.reps, args.warmup)
    return cuda_table(torch, sizes, args.reps, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
