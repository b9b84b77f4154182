#!/usr/bin/env python3
"""Train a small character-level transformer language model with shardgrad's ShardedAdamW.

    # W ranks as processes (one rank per process, Comm.mpi; Open MPI as root needs
    # --allow-run-as-root, and more ranks than cores --oversubscribe; on Slurm: srun -n 2 ...):
    mpirun -np 2 python3 examples/python/train_lm.py
    # W ranks as processes started by torchrun (gloo process group, Comm.from_torch):
    torchrun --nproc_per_node 2 examples/python/train_lm.py
    # W ranks as threads of this process (Comm.local):
    python3 examples/python/train_lm.py --ranks 2
    # your own text instead of the generated corpus:
    python3 examples/python/train_lm.py --ranks 2 --text some_book.txt
    # real text every machine has (4 MB of the Python standard library's sources), the
    # held-out loss (the last 10%) every 50 steps, the curves as JSON:
    python3 examples/python/train_lm.py --ranks 2 --stdlib-corpus 4 --eval-every 50 --json lm.json
    # any ShardedAdamW keyword (it wins over the flags), e.g. AdamW's eps:
    python3 examples/python/train_lm.py --ranks 2 --opt eps=1e-6
    # a Chrome trace per rank (chrome://tracing, https://ui.perfetto.dev) of steps 2.. :
    python3 examples/python/train_lm.py --ranks 2 --trace /tmp/lm-%r.json
    # the parameter all-gathers of each step overlapping the next forward pass:
    python3 examples/python/train_lm.py --ranks 2 --overlap-gather --trace /tmp/lm-%r.json
    # on the GPU (a CUDA build of the library): 2 ranks as threads sharing cuda:0
    python3 examples/python/train_lm.py --device cuda --ranks 2
    # the loss curve and the memory per rank beside NO_SHARD's, as a PNG (matplotlib):
    python3 examples/python/train_lm.py --ranks 2 --plot /tmp/lm.png
    # hybrid sharding: 4 ranks as 2 nodes of 2, sharded in a node, replicated across nodes:
    mpirun -np 4 python3 examples/python/train_lm.py --hybrid 2 --micro 4
    torchrun --nproc_per_node 4 examples/python/train_lm.py --hybrid 2 --micro 4

The package and its library come from `pip install ./python`, or from this checkout (the
library from build/, or SHARDGRAD_LIBRARY). `--help` lists every flag with its default; a bad
flag is one line on stderr and exit status 2, before torch is even imported. Log lines end with
the time left (eta); on a terminal rank 0 also draws a progress bar. Each rank trains on its own random windows of the corpus; gradients are averaged
over ranks, AdamW state is sharded (SHARD_GRAD_OP unless --strategy says otherwise). Rank 0
prints loss and throughput; every rank prints its memory at the end. Exits with status 1 if
the loss did not fall. With --trace, rank 0 also prints how much of the gradient reduction time
ran while the backward pass was still computing, and how much of the parameter all-gather time
the training loop did not wait for (shardgrad.trace_overlap).

--overlap-gather: overlap_param_gather=1. opt.step() returns once the all-gathers of the
updated parameters are queued, bucket by bucket, and ShardedAdamW's forward pre-hooks make each
module wait only for its own parameters, so the gathers run behind the next forward pass
(without it they only overlap the AdamW of the other buckets, and step() waits for the last).

--device cuda: model, batches and the library's state on the GPU. Ranks as threads all share
cuda:0, each with its own CUDA stream (as one process per GPU would have its own): forward,
backward and step run inside `with torch.cuda.stream(s)`, and ShardedAdamW orders the library's
work after that stream. Under mpirun each process takes GPU (local rank mod GPU count). With
several ranks as threads ShardedAdamW hands the gradients over at step() instead of during the
backward pass (see shardgrad/torch/, the package text), so --trace shows no overlap there.

--hybrid N: the ranks as N nodes of consecutive ranks (Comm.split_nodes); ShardedAdamW shards
inside a node (the shard communicator) and is replicated across nodes (replica_comm): each
micro-batch's gradients are reduced inside the node, and once per step one all-reduce of the
shard crosses nodes, started during the last micro-batch's backward pass (Engine.
set_microbatches). No no_sync is needed, so none is used.
"""

import argparse
import ast
import contextlib
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import threading
import time


def under_mpirun():
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                         "SLURM_STEP_ID"))


def under_torchrun():
    return "TORCHELASTIC_RUN_ID" in os.environ and not under_mpirun()


PROG = "train_lm.py"
MAX_SEQ = 4096  # attention is O(seq^2) per head: 4096 is ~2 GiB of scores per layer at batch 8


def fail(msg):
    """A command-line error: one line on stderr, exit status 2 (as argparse's)."""
    sys.stderr.write("%s: %s\n" % (PROG, msg))
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (without the usage block)."""

    def error(self, message):
        fail("%s (%s --help lists the flags)" % (message, PROG))


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help only where the help does not say its default
    itself and there is one to show (not None, not a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def plural(n, word):
    return "%d %s%s" % (n, word, "" if n == 1 else "s")


def check_args(args):
    """Every flag's range, and the combinations that cannot work; fail() on the first."""
    def at_least(name, lo):
        v = getattr(args, name.lstrip("-").replace("-", "_"))
        if v is not None and v < lo:
            fail("%s must be >= %s (got %s)" % (name, lo, v))

    for name in ("--steps", "--batch", "--micro", "--seq", "--d", "--heads", "--layers",
                 "--bucket-kib", "--log-every", "--ranks", "--threads", "--hybrid"):
        at_least(name, 1)
    if args.hybrid is not None and args.strategy == "no_shard":
        fail("--hybrid shards inside a node: it needs --strategy shard_grad_op or shard_opt")
    if args.hybrid is not None and args.ranks is not None and args.ranks % args.hybrid:
        fail("--hybrid %d: --ranks %d is not a multiple of the %d nodes (every node needs the "
             "same number of ranks)" % (args.hybrid, args.ranks, args.hybrid))
    at_least("--seed", 0)
    at_least("--eval-every", 0)
    at_least("--eval-batches", 1)
    if args.text and args.stdlib_corpus is not None:
        fail("--text and --stdlib-corpus name two corpora: choose one")
    if args.stdlib_corpus is not None and not 0 < args.stdlib_corpus <= 64:
        fail("--stdlib-corpus MB must be in (0, 64] (got %s)" % args.stdlib_corpus)
    if not 0 <= args.heldout < 1:
        fail("--heldout must be in [0, 1) (got %s)" % args.heldout)
    if args.eval_every and args.heldout == 0:
        fail("--eval-every needs a held-out part (--heldout > 0)")
    args.opt_kw = {}
    for kv in args.opt:
        key, eq, val = kv.partition("=")
        if not eq or not key.isidentifier():
            fail("--opt %s: expected KEY=VALUE" % kv)
        try:
            args.opt_kw[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            args.opt_kw[key] = val
    at_least("--clip", 0.0)
    if not args.lr > 0 or not math.isfinite(args.lr):
        fail("--lr must be a finite number > 0 (got %s)" % args.lr)
    if args.d % args.heads:
        fail("--heads %d does not divide --d %d (each head takes d / heads features)"
             % (args.heads, args.d))
    if args.seq > MAX_SEQ:
        fail("--seq %d is above %d: attention memory grows with seq^2 (%d x %d scores per head)"
             % (args.seq, MAX_SEQ, args.seq, args.seq))
    if args.offload and args.strategy == "no_shard":
        fail("--offload needs --strategy shard_grad_op or shard_opt (no_shard keeps the whole "
             "optimizer state on every rank)")
    if args.ranks is not None and args.ranks > 64:
        fail("--ranks %d: at most 64 ranks as threads" % args.ranks)
    if args.ranks is not None and (under_mpirun() or under_torchrun()):
        fail("--ranks %d asks for threads, but %s started this process: each process "
             "would train alone; drop --ranks (one rank per process)"
             % (args.ranks, "mpirun" if under_mpirun() else "torchrun"))
    for name in ("trace", "plot", "json"):
        path = getattr(args, name)
        if path is not None:
            d = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(d):
                fail("--%s %s: no directory %s" % (name, path, d))
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib (pip install matplotlib)")


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as ex:
        fail("cannot read --text %s: %s" % (path, ex.strerror or ex))
    except UnicodeDecodeError as ex:
        fail("--text %s is not UTF-8 text (byte %d)" % (path, ex.start))


def stdlib_corpus(nchars):
    """The .py files of this Python's standard library (site-packages excluded), in sorted
    path order, joined and cut at nchars: a real text that every machine with Python has, the
    same on every machine with the same Python version (the version and a digest are printed)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = sorted(x for x in subdirs if x not in ("site-packages", "dist-packages",
                                                             "__pycache__"))
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    parts, size = [], 0
    for path in sorted(files, key=lambda f: os.path.relpath(f, root)):
        try:
            with open(path, encoding="utf-8") as f:
                t = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(t)
        size += len(t)
        if size >= nchars:
            break
    text = "".join(parts)[:nchars]
    print("corpus: %d characters of the Python %s standard library in %s (sha256 %s...)" % (
        len(text), platform.python_version(), root,
        hashlib.sha256(text.encode()).hexdigest()[:12]), flush=True)
    return text


def parse_args(argv=None):
    """The command line, checked: fail() on the first bad flag."""
    ap = OneLineParser(prog=PROG, description=__doc__.split("\n")[1],
                       formatter_class=DefaultsFormatter)
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks as threads of this process (default: one rank per process under "
                    "mpirun, srun or torchrun, else 1)")
    ap.add_argument("--text", help="train on this UTF-8 text file instead of a generated corpus")
    ap.add_argument("--stdlib-corpus", type=float, default=None, metavar="MB",
                    help="train on the first MB megabytes of this Python's standard library "
                    "sources, in sorted path order (real text every machine has)")
    ap.add_argument("--heldout", type=float, default=0.1, metavar="FRACTION",
                    help="the last FRACTION of the text is held out (never trained on)")
    ap.add_argument("--eval-every", type=int, default=0, metavar="N",
                    help="held-out loss every N steps and at the end (0: off)")
    ap.add_argument("--eval-batches", type=int, default=8,
                    help="batches of --batch sequences per held-out evaluation (fixed windows)")
    ap.add_argument("--json", metavar="PATH",
                    help="write rank 0's losses and held-out losses to PATH as JSON")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="one more ShardedAdamW keyword (repeatable), e.g. --opt "
                    "optim_state_dtype=q8; VALUE is read as a Python literal, else a string")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per step (no_sync)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence (at most %d)"
                    % MAX_SEQ)
    ap.add_argument("--d", type=int, default=128, help="model width")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    ap.add_argument("--strategy", default="shard_grad_op",
                    choices=["shard_grad_op", "shard_opt", "no_shard"],
                    help="what is sharded across ranks: shard_grad_op (ZeRO-2: gradients and "
                    "optimizer state), shard_opt (ZeRO-1: optimizer state), no_shard (plain "
                    "data parallel)")
    ap.add_argument("--hybrid", type=int, default=None, metavar="N",
                    help="hybrid sharding over N nodes of consecutive ranks (sharded inside a "
                    "node, replicated across nodes); the rank count must be a multiple of N")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"],
                    help="model parameters, as examples/mlp spells them (f16: with the "
                    "library's dynamic loss scaling)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the model and the library's state live (cuda: a CUDA build of "
                    "the library; ranks as threads share cuda:0)")
    ap.add_argument("--bucket-kib", type=int, default=1024, help="gradient bucket size (KiB)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads per rank (default: cores / local ranks)")
    ap.add_argument("--log-every", type=int, default=20, help="print every N steps")
    ap.add_argument("--trace", metavar="PATH",
                    help="write a Chrome trace of steps 2.. to PATH (%%r: the rank) and print "
                    "how much reduction time the backward pass hid and how much all-gather "
                    "time the loop did not wait for")
    ap.add_argument("--overlap-gather", action="store_true",
                    help="overlap_param_gather: step() returns with the parameter all-gathers "
                    "still running; each module waits for its own in a forward pre-hook")
    ap.add_argument("--offload", action="store_true",
                    help="offload_optimizer: fp32 master weights, Adam moments and gradient "
                    "accumulator in pinned host memory, AdamW on the CPU (with --device cuda; "
                    "needs --strategy shard_grad_op or shard_opt; on cpu it changes nothing)")
    ap.add_argument("--plot", metavar="FILE",
                    help="draw the loss curve and the memory per rank beside NO_SHARD's to a "
                    "PNG (needs matplotlib)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    args = ap.parse_args(argv)
    check_args(args)
    args.corpus = None
    if args.text:
        args.corpus = read_text(args.text)
    elif args.stdlib_corpus is not None:
        args.corpus = stdlib_corpus(int(args.stdlib_corpus * 1e6))
    if args.corpus is not None:
        n = len(args.corpus)
        held = n - int(n * (1 - args.heldout))
        if n - held < args.seq + 2 or (args.heldout > 0 and held < args.seq + 2):
            need = math.ceil((args.seq + 2) / min(1 - args.heldout, args.heldout or 1)) + 1
            fail("--seq %d with --heldout %s needs a text of at least %d characters (%s has %d)"
                 % (args.seq, args.heldout, need, args.text or "the corpus", n))
    return args


# The command line is checked before torch is imported (seconds): a bad flag fails at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))  # run from a checkout

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402

# ------------------------------------------------------------------------------------------
# data


def generate_corpus(n_sentences=6000, seed=1234):
    """English-like text from a small grammar: enough structure for a tiny model to learn."""
    rnd = random.Random(seed)
    subj = ["the cat", "a dog", "the old man", "my sister", "the bird", "a child", "the farmer",
            "our teacher", "the small fox", "a sailor"]
    verb = ["sees", "likes", "finds", "follows", "paints", "carries", "watches", "feeds",
            "remembers", "greets"]
    obj = ["the red ball", "a green apple", "the river", "an empty box", "the tall tree",
           "a quiet house", "the morning sun", "a wooden boat", "the long road", "a letter"]
    tail = ["", " today", " at night", " in the garden", " near the sea", " every morning",
            " with great care", " again"]
    out = []
    for _ in range(n_sentences):
        s = "%s %s %s%s." % (rnd.choice(subj), rnd.choice(verb), rnd.choice(obj),
                              rnd.choice(tail))
        out.append(s[0].upper() + s[1:])
    return " ".join(out) + "\n"


class CharData:
    """Characters as tokens; the last `heldout` fraction of the text is never trained on."""

    def __init__(self, text, heldout=0.0):
        chars = sorted(set(text))
        self.itos = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * (1 - heldout))
        self.data, self.heldout = ids[:cut], ids[cut:]

    def heldout_batches(self, n, batch, seq):
        """The same n batches on every call and rank: windows spread evenly over the part."""
        span = len(self.heldout) - seq - 1
        starts = [(i * span) // max(1, n * batch - 1) for i in range(n * batch)]
        w = torch.stack([self.heldout[i:i + seq + 1] for i in starts])
        return w.reshape(n, batch, seq + 1)

    @property
    def vocab(self):
        return len(self.itos)

    def batch(self, gen, batch, seq):
        ix = torch.randint(0, len(self.data) - seq - 1, (batch,), generator=gen)
        return torch.stack([self.data[i:i + seq + 1] for i in ix.tolist()])

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)


# ------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, vocab, d, heads, layers, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
        h = self.tok(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               tokens[:, 1:].reshape(-1))

    @torch.no_grad()
    def generate(self, ids, n, seq):
        x = torch.tensor([ids], dtype=torch.long, device=self.head.weight.device)
        for _ in range(n):
            logits = self(x[:, -seq:])[0, -1]
            x = torch.cat([x, logits.argmax().view(1, 1)], dim=1)
        return x[0].tolist()


# ------------------------------------------------------------------------------------------
# training

# torch's default random generator is global: rank threads seed it and draw the initial weights
# one at a time, so that every rank (rank 0 included) gets the seed's model.
_MODEL_INIT = threading.Lock()


@torch.no_grad()
def heldout_loss(model, batches):
    """Mean loss over the held-out batches, the model in eval mode meanwhile."""
    was = model.training
    model.eval()
    loss = sum(model.loss(b).item() for b in batches) / len(batches)
    model.train(was)
    return loss


def rss_mib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def trace_path(path, world):
    """Every rank writes its own file: %r becomes the rank (added before the extension when
    several ranks share a path without it)."""
    if world > 1 and "%r" not in path:
        root, ext = os.path.splitext(path)
        path = root + "-%r" + ext
    return path


def finish_trace(engine, path, rank, world, note="", overlap_gather=False):
    """Stops the trace, writes it, and (rank 0) prints the overlap summary: the reductions
    against the backward pass, then the all-gathers (per step: their time, the share the
    training loop did not wait for, and the time it did wait)."""
    engine.trace_stop()
    events, dropped = engine.trace_events()
    path = trace_path(path, world)
    engine.trace_write(path)
    if rank == 0:
        ov = sg.trace_overlap(events)
        print("trace: %s (%d events, %d dropped): reductions %.1f ms over %d steps, %.0f%% of "
              "the reduction time hidden behind the backward pass, %.1f ms exposed" % (
                  path.replace("%r", "0"), len(events), dropped, ov["reduce_us"] / 1e3,
                  ov["steps"], 100 * ov["hidden_fraction"], ov["exposed_us"] / 1e3) + note,
              flush=True)
        k = 1e-3 / max(ov["steps"], 1)  # us in all -> ms per step
        print("trace: all-gather %.3f ms/step, %.0f%% of it hidden behind AdamW%s (%.3f ms/step "
              "exposed)" % (ov["gather_us"] * k, 100 * ov["gather_hidden_fraction"],
                            " and the forward pass" if overlap_gather else "",
                            ov["gather_exposed_us"] * k), flush=True)


def rank_device(args, comm):
    """torch.device of this rank: the CPU, cuda:0 for ranks as threads, or under mpirun
    GPU (local rank mod GPU count)."""
    if args.device != "cuda":
        return torch.device("cpu")
    index = 0
    if comm.kind != "local":
        local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                                        os.environ.get("MPI_LOCALRANKID", "0")))
        index = local_rank % torch.cuda.device_count()
    return torch.device("cuda", index)


def train_rank(comm, args, data, out):
    """One rank's training; on CUDA inside a stream of its own (see the module text)."""
    device = rank_device(args, comm)
    ctx = contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's current device
        ctx = torch.cuda.stream(torch.cuda.Stream(device))
    with ctx:
        return train_rank_on(comm, args, data, out, device)


def train_rank_on(comm, args, data, out, device):
    rank, world = comm.rank, comm.size
    with _MODEL_INIT:
        torch.manual_seed(args.seed)  # every rank builds the same model (rank 0's is broadcast)
        model = CharLM(data.vocab, args.d, args.heads, args.layers, args.seq)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    elif args.dtype == "f16":
        model = model.to(torch.float16)  # the library keeps fp32 masters and scales the loss
    if device.type == "cuda":
        model = model.to(device)
    nparams = sum(p.numel() for p in model.parameters())
    shard = replica = None
    if args.hybrid:
        if world % args.hybrid:  # under mpirun: every rank sees the same world and stops
            fail("--hybrid %d: %d ranks are not a multiple of the %d nodes (every node needs "
                 "the same number of ranks)" % (args.hybrid, world, args.hybrid))
        shard, replica = comm.split_nodes(world // args.hybrid)
    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, no_decay="1d",
              strategy=args.strategy, max_grad_norm=args.clip, bucket_bytes=args.bucket_kib << 10,
              overlap_param_gather=args.overlap_gather, offload_optimizer=args.offload,
              replica_comm=replica)
    kw.update(args.opt_kw)  # --opt KEY=VALUE wins over the flags
    opt = ShardedAdamW(model, shard or comm, **kw)
    if args.hybrid:  # the cross-node all-reduce starts in the last micro-batch's backward
        opt.engine.set_microbatches(args.micro)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank: own data
    tokens_per_step = world * args.micro * args.batch * args.seq
    if rank == 0:
        where = ""
        if device.type == "cuda":
            where = ", on %s (%s)" % (device, torch.cuda.get_device_name(device))
        layout = (", hybrid: %s x %s" % (plural(args.hybrid, "node"),
                                          plural(world // args.hybrid, "rank"))
                  if args.hybrid else "")
        print("model: %d parameters (%s, d=%d), vocab %d, %s (%s%s), %s, %s params"
              "%s%s" % (nparams, plural(args.layers, "layer"), args.d, data.vocab, plural(world, "rank"),
                        comm.kind, layout,
                 opt.engine.config.strategy.name, args.dtype, where,
                 ", all-gathers overlapping the forward pass" if args.overlap_gather else ""),
              flush=True)
    losses, evals = [], []
    held = (data.heldout_batches(args.eval_batches, args.batch, args.seq).to(device)
            if args.eval_every else None)
    t0 = time.perf_counter()
    t_last, tok_last = t0, 0
    bar = Progress(args.steps) if rank == 0 else None
    for step in range(1, args.steps + 1):
        loss_sum = 0.0
        for m in range(args.micro):
            x = data.batch(gen, args.batch, args.seq)  # sampled on the CPU on every device
            if device.type == "cuda":
                x = x.to(device)
            if m < args.micro - 1 and not args.hybrid:
                with opt.no_sync():  # accumulate locally, reduce with the last micro-batch
                    loss = model.loss(x) / args.micro
                    if args.trace and step > 1:
                        opt.engine.trace_mark("backward")
                    opt.scale_loss(loss).backward()  # the loss scale is 1 but for f16
            else:
                loss = model.loss(x) / args.micro
                if args.trace and step > 1:
                    opt.engine.trace_mark("backward")  # where the backward pass begins
                opt.scale_loss(loss).backward()
            loss_sum += loss.item()
        opt.step()
        sched.step()
        if args.trace and step == 1:
            # from the second step on: the first backward finalizes the engine (warm-up)
            opt.engine.trace_start()
        losses.append(loss_sum)
        if held is not None and (step % args.eval_every == 0 or step == args.steps):
            evals.append((step, heldout_loss(model, held)))
            if rank == 0:
                print("step %4d  held-out loss %.4f" % evals[-1], flush=True)
        if rank == 0 and (step % args.log_every == 0 or step == 1 or step == args.steps):
            now = time.perf_counter()
            tok = step * tokens_per_step
            rate = (tok - tok_last) / max(now - t_last, 1e-9)
            info = opt.last_step_info
            bar.clear()
            print("step %4d  loss %.4f  lr %.2e  grad-norm %.3f  %8.0f tokens/s  eta %s" % (
                step, loss_sum, opt.lr, info.grad_norm, rate, bar.eta(step)), flush=True)
            t_last, tok_last = now, tok
        if bar is not None and step < args.steps:
            bar.draw(step)
    if bar is not None:
        bar.clear()
    elapsed = time.perf_counter() - t0
    if args.trace and args.steps > 1:
        note = ""
        if device.type == "cuda" and comm.kind == "local" and world > 1:
            note = " (ranks as threads on CUDA: gradients reach the library at step())"
        finish_trace(opt.engine, args.trace, rank, world, note, args.overlap_gather)
    mem = opt.memory()
    mem_ddp = sg.estimate_memory([p.numel() for p in model.parameters()], world,
                                 config=opt.engine.config.copy(strategy="no_shard",
                                                               offload_optimizer=False))
    sample = None
    if rank == 0:
        prompt = data.data[:16].tolist()
        sample = data.decode(model.generate(prompt, 80, args.seq))
    out[rank] = dict(losses=losses, evals=evals, mem=mem, mem_ddp=mem_ddp, elapsed=elapsed, tokens=args.steps * tokens_per_step,
                     sample=sample, nparams=nparams)
    opt.close()
    for c in (shard, replica):
        if c is not None:
            c.close()
    return out[rank]


class Progress:
    """The time left (eta) at the mean step time so far, and a progress bar redrawn in place at
    most 10 times a second when stdout is a terminal (not under mpirun, whose processes write
    to a pseudo-terminal of the launcher's)."""

    def __init__(self, steps):
        self.steps, self.t0, self.drawn = steps, time.perf_counter(), 0.0
        self.tty = sys.stdout.isatty() and not under_mpirun() and not under_torchrun()

    def eta(self, done):
        left = (time.perf_counter() - self.t0) / max(done, 1) * (self.steps - done)
        s = int(left + 0.5)
        if s >= 3600:
            return "%dh%02dm" % (s // 3600, s // 60 % 60)
        return "%dm%02ds" % (s // 60, s % 60) if s >= 60 else "%ds" % s

    def draw(self, done):
        now = time.perf_counter()
        if not self.tty or now - self.drawn < 0.1:
            return
        self.drawn = now
        fill = 40 * done // self.steps
        sys.stdout.write("\r[%s%s] %d/%d  eta %s" % ("#" * fill, "." * (40 - fill), done,
                                                     self.steps, self.eta(done)))
        sys.stdout.flush()

    def clear(self):
        if self.tty:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def plot(path, results, kind, strategy):
    """The loss of every rank against the step, and each rank's memory beside NO_SHARD's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for r, res in enumerate(results):
        a.plot(range(1, len(res["losses"]) + 1), res["losses"], label="rank %d" % r, lw=1)
    a.set_xlabel("step")
    a.set_ylabel("loss (each rank's own batches)")
    a.set_title("training loss, %s (%s)" % (plural(len(results), "rank"), kind))
    a.grid(True, alpha=0.3)
    if len(results) <= 8:
        a.legend()
    mib = float(1 << 20)
    this = [res["mem"].total_bytes / mib for res in results]
    ddp = results[0]["mem_ddp"].total_bytes / mib
    b.bar(["rank %d" % r for r in range(len(this))] + ["NO_SHARD"], this + [ddp],
          color=["tab:blue"] * len(this) + ["tab:gray"])
    b.set_ylabel("MiB per rank (library state)")
    b.set_title("%s vs NO_SHARD" % strategy)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print("plot: %s" % path)


def loss_trend(results):
    """Mean loss over ranks of the first and the last n steps."""
    r0 = results[0]
    n = max(1, min(10, len(r0["losses"]) // 4))
    first = sum(sum(r["losses"][:n]) / n for r in results) / len(results)
    last = sum(sum(r["losses"][-n:]) / n for r in results) / len(results)
    return first, last, n


def print_memory(rank, res):
    mem = res["mem"]
    mib = 1 << 20
    print("rank %d memory: library %.2f MiB (params %.2f, grads %.2f, master %.2f, optim %.2f, "
          "comm %.2f; peak %.2f), %d of %d elements in this rank's shard; process RSS %.0f MiB"
          % (rank, mem.total_bytes / mib, mem.params_bytes / mib, mem.grads_bytes / mib,
             mem.master_bytes / mib, mem.optim_bytes / mib, mem.comm_bytes / mib,
             mem.peak_bytes / mib, mem.shard_numel, mem.numel, rss_mib()), flush=True)
    if mem.host_bytes:
        print("rank %d offloaded optimizer state: %.2f MiB of pinned host memory"
              % (rank, mem.host_bytes / mib), flush=True)




def main(args):
    if args.device == "cuda":
        if not torch.cuda.is_available():
            fail("--device cuda: torch sees no CUDA GPU (torch.cuda.is_available() is "
                     "False; torch %s, built for CUDA %s)"
                     % (torch.__version__, torch.version.cuda))
        if not sg.has_backend("cuda"):
            fail("--device cuda: %s was built without CUDA (configure with "
                     "-DSG_WITH_CUDA=ON, or point SHARDGRAD_LIBRARY at a CUDA build)"
                     % sg.library_path())

    data = CharData(args.corpus if args.corpus is not None else generate_corpus(), args.heldout)

    use_torch = args.ranks is None and under_torchrun()
    use_mpi = args.ranks is None and under_mpirun()
    local = 1 if use_mpi else (args.ranks or 1)
    if use_mpi:
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    if use_torch:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local))

    out = {}
    if use_mpi or use_torch:
        if use_torch:  # torchrun's env:// rendezvous; shardgrad's bytes go through the group
            import torch.distributed as dist
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            comm = sg.Comm.from_torch()
        else:
            comm = sg.Comm.mpi()
        rank, world = comm.rank, comm.size
        res = train_rank(comm, args, data, out)
        print_memory(rank, res)
        kind = comm.kind
        comm.close()
        if use_torch:
            dist.destroy_process_group()
        if rank != 0:
            return 0
        results = [res]
    else:
        sg.run_threads(local, train_rank, args, data, out)
        world, results, kind = local, [out[r] for r in range(local)], "local"
        for r in range(world):
            print_memory(r, out[r])
    first, last, n = loss_trend(results)
    r0 = results[0]
    print("%s (%s): %d steps in %.1f s, %.0f tokens/s overall" % (
        plural(world, "rank"), kind, len(r0["losses"]), r0["elapsed"], r0["tokens"] / r0["elapsed"]))
    print("sample: %r" % r0["sample"])
    if args.plot:
        plot(args.plot, results, kind, args.strategy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k != "corpus"},
                           world=world, losses=r0["losses"], evals=r0["evals"],
                           elapsed=r0["elapsed"], tokens=r0["tokens"]), f)
    fell = last < first - 0.1
    print("loss %s from %.4f (mean of the first %d steps) to %.4f (mean of the last %d)"
          % ("fell" if fell else "did NOT fall", first, n, last, n), flush=True)
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
