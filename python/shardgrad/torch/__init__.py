"""PyTorch integration: ShardedAdamW, a torch.optim.Optimizer backed by a shardgrad Engine.

    import shardgrad as sg
    from shardgrad.torch import ShardedAdamW

    comm = sg.Comm.mpi()                         # one rank per process (mpirun -np 2 ...)
    opt = ShardedAdamW(model, comm, lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    for batch in data:                           # this rank's part of the global batch
        loss = model(batch).mean()
        loss.backward()                          # gradients go to the library as they appear
        opt.step(); sched.step()

What it does
 - Every trainable parameter's storage is re-pointed to the library's working parameters
   (zero copy): sg_step's all-gather updates the model in place.
 - Parameter order and when the engine is built. param_order="registration" (the default):
   in the constructor, in named_parameters order (the plan reduces buckets in the reverse
   order, which is backward order when modules are registered in the order the forward pass
   uses them, as in nn.Sequential and the usual transformer). The constructor briefly holds
   the parameters twice (torch's and the library's), before any activation exists; every
   training step, the first included, then peaks at the same memory (issue 16).
   param_order="backward": the plan follows the order the first forward pass uses the
   parameters (module registration order may differ from execution order; DDP rebuilds its
   buckets for the same reason). Forward pre-hooks record it, and the engine is built when
   the first gradient arrives, so no full gradient is held, but step 1 holds torch's copy of
   the parameters (autograd's saved tensors use it) beside the library's until its backward
   has passed them. Parameters used by no module's own forward go last in the backward order;
   without an nn.Module the order is the iterable's.
 - A post-accumulate-grad hook hands each gradient to the library (sg_grad_add) as soon as
   autograd has produced it, then drops it from `.grad`, so under SHARD_GRAD_OP the full
   gradient never sits in memory. At the end of each backward sg_backward_end completes the
   micro-batch (parameters that got no gradient count as zeros) and every parameter's `.grad`
   becomes a ShardGrad: a tensor standing for the reduced gradient held in the library, whose
   norm (torch.nn.utils.clip_grad_norm_, get_total_norm, accelerate's and Lightning's clipping)
   is the true global norm and whose in-place scaling scales the library's gradient; any other
   use raises (docs/torch-grads.md).
 - Several backward passes before step() accumulate (each is a micro-batch that is reduced
   right away); inside `with opt.no_sync():` micro-batches accumulate locally without
   communication.
 - The reduced gradient is the average over ranks (grad_average=1) of each rank's summed
   gradient: exactly what DDP with .grad accumulation gives.
 - Every param group's 'lr' and 'weight_decay' are read at every step(), so torch LR
   schedulers drive them.
 - Parameter groups (per-group lr and weight_decay, up to shardgrad.MAX_GROUPS): pass
   torch-style groups, ShardedAdamW([{"params": [...], "lr": 1e-2}, {"params": [...],
   "weight_decay": 0.0}], comm, lr=1e-3) (a group's "params" may hold (name, parameter)
   pairs), or a model plus param_groups=[...] of some of its parameters (the others form one
   more group, last, with the constructor's values); keys a group lacks take the
   constructor's. betas and eps are the same for every group. With explicit groups every
   parameter decays by its group's weight_decay, as in torch (no_decay still applies when
   given).
 - Weight decay as torch.optim.AdamW: every parameter decays by its group's weight_decay.
   no_decay="1d" exempts the parameters with ndim <= 1 (biases, norms; the usual GPT recipe),
   a set of names or a callable (name, param) -> bool exempts those it names. Parameters with
   requires_grad=False are left alone.
 - Bucket size: without bucket_bytes (and without config=), buckets are 1/8 of the model's
   gradient bytes, rounded up to 64 KiB and kept within 64 KiB..32 MiB, so that the staging
   buckets (2 by default) hold a quarter of the gradient and the first reductions start
   while backward is still running; bucket_bytes= or config= choose otherwise.

Overlapped all-gather (overlap_param_gather=True): step() returns as soon as the per-bucket
all-gathers of the updated parameters are queued (the bucket of the first registered
parameters first), and they overlap the next forward pass. A forward pre-hook on every module
that directly owns parameters (recurse=False; tied parameters count for every module holding
them) waits for exactly those parameters' buckets before the module runs, so each layer waits
only for its own bucket, in whatever order the forward pass uses them. Parameters read
outside their own module's forward (e.g. a parent module using child.weight in its own
forward, or code inspecting p after step()) are not covered: call opt.wait_params() first.
Needs an nn.Module as `model`. close() removes the hooks; library calls (state_dict, save,
master_weights...) wait by themselves.

Threads: with sg.Comm.local(n), build one model replica and one ShardedAdamW per rank, each in
its own thread (sg.run_threads). Collective (every rank, same order): the constructor (with
param_order="backward": the first backward), step, state_dict, param_state, master_weights.

close() (or garbage collection of the optimizer) copies the parameters back into torch-owned
memory and removes the hooks. Tensors made from the parameters before that (a user's
p.detach(), autograd's saved tensors) still view the library's memory: the engine is then
destroyed only when the last of them is gone (the communicator may be closed before; it is
destroyed after the engine).

CUDA parameters (the engine runs on the parameters' GPU):
 - Streams: the engine works on the stream that is current when it is set up (the
   constructor; with param_order="backward" the first backward), e.g. a rank's own stream
   inside `with torch.cuda.stream(s):` around forward, backward and step(). On torch's default
   stream (handle 0, which sg_set_stream would read as "an internal stream") it gets a
   stream of its own instead. Either way the streams are ordered with events: the engine's
   stream waits for the current one before it reads a gradient and at step(), and the current
   stream waits for the engine's after step(), load(), import_() and before close() copies
   the parameters back.
 - Several ranks as threads of one process (Comm.local(n), n > 1): torch runs the backward of
   every CUDA tensor, hooks and end-of-backward callbacks included, on one autograd thread per
   GPU shared by all Python threads, so a collective started from there would wait for a peer
   whose backward cannot run. The gradients therefore stay in .grad (accumulated by torch over
   micro-batches) and step() hands them to the library on the rank's own thread, then reduces
   them: no overlap of reductions with the backward pass, and no_sync() changes nothing. One
   rank per process (Comm.mpi, NCCL) keeps the hook path.

The package, one concern per module (none imports one that imports it back; the ctypes layer
below, shardgrad.core and what it uses, imports neither torch nor this package):
 - optim: ShardedAdamW.
 - comm: comm_from_torch (Comm.from_torch) and the transport over a torch.distributed group.
 - groups: which parameters an optimizer takes, their names, parameter groups.
 - hooks: the autograd and forward hooks that hand gradients over and wait for parameters.
 - grads: ShardGrad and GradNorm, the p.grad of the library's gradients.
 - clip: which optimizer holds a parameter; patch_clip_grad_norm(), the opt-in replacement of
   torch.nn.utils.clip_grad_norm_.
 - views: Engine.param_tensor / grad_tensor, zero-copy tensors of library memory.
 - dtypes: torch dtypes and DType.
"""

import torch


def _require_torch(version):
    """ImportError unless `version` (a torch version string) is 2.1 or newer: ShardedAdamW hands
    each gradient over in a post-accumulate-grad hook (Tensor.register_post_accumulate_grad_hook,
    new in torch 2.1)."""
    parts = []
    for x in str(version).split("+")[0].split(".")[:2]:
        digits = "".join(c for c in x if c.isdigit()) if x else ""
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    if tuple(parts) < (2, 1):
        raise ImportError("shardgrad.torch needs torch >= 2.1 (it hands gradients over with "
                          "Tensor.register_post_accumulate_grad_hook, added in 2.1); this is "
                          "torch %s: upgrade torch (pip install 'torch>=2.1')" % (version,))


_require_torch(torch.__version__)

from .clip import patch_clip_grad_norm  # noqa: E402
from .comm import comm_from_torch  # noqa: E402
from .dtypes import sg_dtype, torch_dtype  # noqa: E402
from .grads import GradNorm, ShardGrad  # noqa: E402
from .optim import (MAX_BUCKET_BYTES, MIN_BUCKET_BYTES, ShardedAdamW,  # noqa: E402
                    default_bucket_bytes)

__all__ = ["ShardedAdamW", "ShardGrad", "GradNorm", "comm_from_torch", "default_bucket_bytes",
           "torch_dtype", "sg_dtype", "patch_clip_grad_norm"]
