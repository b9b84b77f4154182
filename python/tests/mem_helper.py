"""Run by test_torch.py in a fresh process: peak resident memory of training steps of W model
replicas in this process (W ranks as threads), with torch.optim.AdamW on every replica
(DDP-style replicated state) or with ShardedAdamW over Comm.local(W).

usage: mem_helper.py MODE(torch|sharded) WORLD OUT_JSON

Measured: VmHWM after the steps minus VmRSS before any optimizer existed (after one
forward/backward without optimizer and one step of a throwaway optimizer, so that torch's own
start-up memory is in the baseline). Large allocations are made with mmap
(MALLOC_MMAP_THRESHOLD_, set by the test) so that freed memory leaves the resident set. The high-water mark is
reset (/proc/self/clear_refs) after one warm-up step, so it covers steady-state steps: both
optimizers then hold their state, and torch's lazily created moments are included.
"""

import copy
import json
import sys
import threading

import torch

import shardgrad as sg
from shardgrad.torch import ShardedAdamW
from sg_models import lm_loss, make_batches, make_model
from sg_rss import reset_peak, status_kib

STEPS = 3
SHAPE = dict(vocab=2048, d=256, heads=8, layers=4, seq=32)


def try_reset_peak():
    """True when the high-water mark could be reset (the result records it)."""
    try:
        reset_peak()
        return True
    except OSError:
        return False


def run_torch(models, batches, world):
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for m in models]
    reset_ok = None
    for s in range(STEPS + 1):
        if s == 1:
            reset_ok = try_reset_peak()
        # every replica holds its full gradient at the same time, as W ranks would
        for r in range(world):
            lm_loss(models[r], batches[s][0][r]).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    peak = status_kib("VmHWM")
    state = sum(t.numel() * t.element_size() for o in opts for st in o.state.values()
                for t in st.values() if torch.is_tensor(t))
    return reset_ok, peak, dict(optimizer_state_bytes=state)


def run_sharded(models, batches, world):
    barrier = threading.Barrier(world)
    flags = {}

    def body(comm):
        r = comm.rank
        opt = ShardedAdamW(models[r], comm, lr=1e-4, bucket_bytes=1 << 20, timeout_ms=120000)
        for s in range(STEPS + 1):
            if s == 1:
                barrier.wait()
                if r == 0:
                    flags["reset"] = try_reset_peak()
                barrier.wait()
            lm_loss(models[r], batches[s][0][r]).backward()
            opt.step()
        barrier.wait()
        if r == 0:  # before the optimizers close (which copies the parameters back)
            flags["peak"] = status_kib("VmHWM")
        return opt.memory()

    mems = sg.run_threads(world, body)
    return flags["reset"], flags["peak"], dict(
        library_total_bytes_per_rank=mems[0].total_bytes, library=mems[0].as_dict())


def main():
    mode, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    base = make_model(0, **SHAPE)
    models = [copy.deepcopy(base) for _ in range(world)]
    del base
    batches = make_batches(1, STEPS + 1, 1, world, 2, seq=SHAPE["seq"], vocab=SHAPE["vocab"])
    nparams = sum(p.numel() for p in models[0].parameters() if p.requires_grad)
    # One forward/backward without an optimizer first: torch's kernels, thread pools and
    # scratch buffers are then part of the baseline, not of either optimizer's peak.
    for r, m in enumerate(models):
        lm_loss(m, batches[0][0][r]).backward()
        m.zero_grad(set_to_none=True)
    # The first torch.optim.Optimizer imports a good part of torch (~140 MiB here): pay it
    # before the baseline, for both modes (ShardedAdamW is an Optimizer too).
    tiny = torch.zeros(4, requires_grad=True)
    tiny.sum().backward()
    torch.optim.AdamW([tiny], foreach=False).step()
    del tiny
    rss0 = status_kib("VmRSS")
    reset_ok, peak, extra = (run_torch if mode == "torch" else run_sharded)(models, batches,
                                                                            world)
    result = dict(mode=mode, world=world, params=nparams, rss_before_kib=rss0, peak_kib=peak,
                  step_peak_bytes=(peak - rss0) * 1024, hwm_reset=reset_ok, **extra)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
