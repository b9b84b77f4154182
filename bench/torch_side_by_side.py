#!/usr/bin/env python3
"""PyTorch's data-parallel recipes and ShardedAdamW side by side, on the same model and data, in
one run, rounds interleaved (issue 16):

  ddp      DistributedDataParallel + torch.optim.AdamW (torch's default CPU path)
  fsdp2    torch.distributed.fsdp.fully_shard(reshard_after_forward=False) + torch.optim.AdamW
           (SHARD_GRAD_OP: parameters kept whole between forward and backward)
  sharded  shardgrad.torch.ShardedAdamW (ZeRO-2), communicator from Comm.from_torch()

The model is a small GPT-style language model (pre-norm transformer blocks, tied embedding;
about 5M parameters with the defaults), fp32 on the CPU. Every round builds each variant from
the same initial weights, runs --warmup steps and then --steps timed steps (forward, backward,
optimizer step), and tears it down; the variants take turns within each round so that machine
noise hits them alike. Per variant it prints:
  - step: the median over rounds of each round's median step time (max over ranks);
  - peak RSS: the resident set's high-water mark during the round (construction included) above
    the resident set before the round, max over ranks (freed memory is returned to the system:
    mallopt sets a 128 KiB mmap threshold);
  - held: bytes of training state per rank after the steps (parameters, gradients, optimizer
    state; counted from the tensors, or sg_memory for ShardedAdamW);
  - the final loss, as a check that all three train the same thing (they use the same data).
and ratios against ddp measured in the same run.

Run with 2 ranks under mpirun (from_torch then uses MPI for shardgrad, gloo serves torch):
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 -x OMP_NUM_THREADS=1 \\
      -x PYTHONPATH=python python3 bench/torch_side_by_side.py
or under torchrun (from_torch then sends shardgrad's bytes through the gloo group itself):
  PYTHONPATH=python torchrun --nproc_per_node 2 bench/torch_side_by_side.py
"""
import argparse
import copy
import ctypes
import gc
import os
import statistics
import sys
import time


def _return_freed_memory():
    # glibc: large blocks from mmap, and trim the heap, so RSS follows what is alive
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD
    except OSError:
        pass


_return_freed_memory()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.proj = torch.nn.Linear(4 * d, d)

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d)
        for emb in (self.tok, self.pos):
            torch.nn.init.normal_(emb.weight, std=0.02)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1),
                             persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.ln(x) @ self.tok.weight.t()  # tied output layer


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def tensor_bytes(ts):
    seen, n = set(), 0
    for t in ts:
        if t is None or not torch.is_tensor(t):
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            n += key[1]
    return n


def torch_held(model, opt, extra=()):
    state = [v for s in opt.state.values() for v in s.values()]
    return tensor_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + state
                        + list(extra))


# -- the three variants: build(base) -> (model, step_fn, held_fn, close_fn) ----------------

HP = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def build_ddp(base, args, comm):
    model = copy.deepcopy(base)
    kw = {} if args.bucket_mb is None else dict(bucket_cap_mb=args.bucket_mb)
    ddp = torch.nn.parallel.DistributedDataParallel(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), **HP)

    def step(tokens):
        loss = loss_of(ddp, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def held():
        # parameters and AdamW state; plus DDP's gradient buckets, which stay allocated
        # between steps (one full gradient; .grad is freed by zero_grad(set_to_none=True))
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        return torch_held(model, opt) + full

    return step, held, lambda: None


def build_fsdp2(base, args, comm):
    from torch.distributed.fsdp import fully_shard
    model = copy.deepcopy(base)
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), **HP)

    def step(tokens):
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def held():
        # sharded parameters, gradients and state; plus the unsharded parameters that
        # reshard_after_forward=False keeps between forward and backward (one full copy)
        full = sum(p.numel() * p.element_size() for p in base.parameters())
        return torch_held(model, opt) + full

    return step, held, lambda: None


def build_sharded(base, args, comm):
    from shardgrad.torch import ShardedAdamW
    model = copy.deepcopy(base)
    kw = {} if args.bucket_mb is None else dict(bucket_bytes=int(args.bucket_mb * (1 << 20)))
    opt = ShardedAdamW(model, comm, **HP, timeout_ms=120000, **kw)

    def step(tokens):
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        return loss

    def held():
        return opt.memory().total_bytes

    return step, held, opt.close


VARIANTS = {"ddp": build_ddp, "fsdp2": build_fsdp2, "sharded": build_sharded}


def run_round(name, base, args, comm, data):
    gc.collect()
    dist.barrier()
    rss0 = status_kib("VmRSS")
    reset_peak()
    step, held, close = VARIANTS[name](base, args, comm)
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(data[i % len(data)])
        times.append(time.perf_counter() - t0)
    peak = status_kib("VmHWM") - rss0
    nheld = held()
    close()
    med = statistics.median(times[args.warmup:])
    return med, peak, nheld, float(loss.detach())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="DDP's bucket_cap_mb and ShardedAdamW's bucket size (default: "
                    "each library's own default)")
    ap.add_argument("--variants", default="ddp,fsdp2,sharded")
    args = ap.parse_args()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import shardgrad as sg
    comm = sg.Comm.from_torch()
    torch.manual_seed(0)
    base = GPT(args.vocab, args.d, args.heads, args.layers, args.seq)
    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data, the same per variant
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            for _ in range(4)]
    names = [v for v in args.variants.split(",") if v]
    buckets = "library defaults" if args.bucket_mb is None else "%g MiB" % args.bucket_mb
    if rank == 0:
        print("torch_side_by_side: torch %s, %d ranks (%s), %.2fM params (vocab %d, d %d, %d "
              "layers, seq %d), batch %d per rank, buckets %s, %d rounds x %d steps (+%d warm-up)"
              % (torch.__version__, world, comm.kind, nparams / 1e6, args.vocab, args.d,
                 args.layers, args.seq, args.batch, buckets, args.rounds, args.steps,
                 args.warmup))
    res = {n: [] for n in names}
    for n in names:  # untimed: torch's and the library's one-time set-up outside the rounds
        run_round(n, base, argparse.Namespace(**dict(vars(args), warmup=0, steps=1)), comm,
                  data)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for n in order:
            res[n].append(run_round(n, base, args, comm, data))
    out = {}
    for n in names:
        t = torch.tensor([[x[0], x[1], x[2]] for x in res[n]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        loss = torch.tensor([res[n][-1][3]], dtype=torch.float64)
        dist.all_reduce(loss)
        out[n] = (statistics.median(t[:, 0].tolist()), max(t[:, 1].tolist()),
                  max(t[:, 2].tolist()), loss.item() / world)
    if rank == 0:
        base_t, base_p, base_h = out[names[0]][:3]
        print("%-8s %10s %8s %14s %8s %14s %8s %11s" % ("variant", "step ms", "vs " + names[0],
              "peak RSS MiB", "vs", "held MiB", "vs", "final loss"))
        for n in names:
            t, p, h, loss = out[n]
            print("%-8s %10.1f %8.2f %14.1f %8.2f %14.1f %8.2f %11.4f"
                  % (n, t * 1e3, t / base_t, p / 1024, p / max(base_p, 1), h / 2 ** 20,
                     h / max(base_h, 1), loss))
    comm.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
