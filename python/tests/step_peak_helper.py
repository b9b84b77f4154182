"""Run by test_torch_users.py in a fresh process: the peak resident memory of each of the first
training steps of ShardedAdamW (one rank), to show that step 1 is no higher than the later
ones (issue 16: the engine used to be built at the end of the first backward, while every full
.grad was alive).

usage: step_peak_helper.py PARAM_ORDER OUT_JSON

Each step is forward + backward + step(); before it the high-water mark is reset
(/proc/self/clear_refs), after it VmHWM is read: the step's peak over the resident set it
started from. Also written: the resident set before the optimizer was built (torch's
parameters in it) and after each step (what the library keeps resident between steps).
Large allocations are made with mmap (MALLOC_MMAP_THRESHOLD_, set by the test) so that freed
memory leaves the resident set.
"""

import json
import sys

import torch

import shardgrad as sg
from shardgrad.torch import ShardedAdamW
from sg_rss import reset_peak, status_kib

STEPS = 4
WIDTH, DEPTH, BATCH = 768, 6, 8


def main():
    order, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(BATCH, WIDTH)
    # torch's kernels and pools warm, outside any measured step
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    # torch.optim's own one-time imports (the first Optimizer loads torch._dynamo) outside too
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    comm = sg.Comm.local(1)[0]
    base = status_kib("VmRSS")  # torch's parameters resident, no optimizer yet
    opt = ShardedAdamW(model, comm, lr=1e-4, param_order=order, timeout_ms=120000)
    peaks, starts, ends = [], [], []
    for _ in range(STEPS):
        reset_peak()
        start = status_kib("VmRSS")
        model(x).square().mean().backward()
        opt.step()
        peaks.append(status_kib("VmHWM"))
        starts.append(start)
        ends.append(status_kib("VmRSS"))
    mem = opt.memory()
    opt.close()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with open(out, "w") as f:
        json.dump(dict(order=order, peaks_kib=peaks, starts_kib=starts, ends_kib=ends,
                       base_kib=base, param_bytes=nbytes,
                       largest_param_bytes=max(p.numel() * p.element_size()
                                               for p in model.parameters()),
                       library=mem.as_dict()), f)


if __name__ == "__main__":
    main()
