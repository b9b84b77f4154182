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
"""

import contextlib
import functools
import json
import os
import tempfile
import uuid
import weakref

import numpy as np
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

from . import _lib  # noqa: E402
from ._structs import MAX_GROUPS, DType, Device
from ._torch_grad import GradNorm, GradState, ShardGrad  # noqa: E402
from .config import Config  # noqa: E402
from .core import Comm, Engine, has_backend  # noqa: E402
from .errors import (InvalidArgumentError, InvalidStateError, MismatchError,  # noqa: E402
                     ShardgradError, UnsupportedError)

__all__ = ["ShardedAdamW", "ShardGrad", "GradNorm", "comm_from_torch", "default_bucket_bytes",
           "torch_dtype", "sg_dtype", "patch_clip_grad_norm"]

_TO_SG = {torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16}
_TO_TORCH = {v: k for k, v in _TO_SG.items()}


def sg_dtype(dt):
    """DType of a torch dtype (float32, bfloat16, float16)."""
    if dt not in _TO_SG:
        raise InvalidArgumentError("no shardgrad dtype for %s" % dt, function="python")
    return _TO_SG[dt]


def torch_dtype(dt):
    return _TO_TORCH[DType(dt)]


# ------------------------------------------------------------------------------------------
# communicators from torch.distributed

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def _dist_initialized():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _started_by_mpirun():
    return any(k in os.environ for k in _MPI_ENV)


def comm_from_torch(group=None):
    """Collective over `group` (default: the whole world): a shardgrad communicator with the
    same ranks as an initialized torch.distributed process group (Comm.from_torch).

    - NCCL group (CUDA): an NCCL communicator on torch's current CUDA device, its unique id made
      by the group's rank 0 and shared through the group (broadcast_object_list).
    - A job started by mpirun (the whole world only): Comm.mpi(), checked to give every process
      the rank torch gave it.
    - Otherwise (gloo on CPU under torchrun): a communicator whose transfers go through the
      group itself, when the library has that transport (sg_comm_create_xport); else
      UnsupportedError saying what to do instead.
    """
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidStateError("Comm.from_torch: torch.distributed is not initialized (call "
                                "torch.distributed.init_process_group first, e.g. under "
                                "torchrun)", function="python")
    g = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    backend = str(dist.get_backend(g)).lower()
    if "nccl" in backend:
        return _nccl_from_torch(dist, g, rank, world)
    whole = world == dist.get_world_size()
    if whole and _started_by_mpirun() and has_backend("mpi"):
        comm = Comm.mpi()
        if comm.size != world or comm.rank != rank:
            got = (comm.rank, comm.size)
            comm.close()
            raise MismatchError("Comm.from_torch: MPI gives this process rank %d of %d, torch "
                                "rank %d of %d: start torch with the ranks mpirun assigned "
                                "(RANK=$OMPI_COMM_WORLD_RANK)" % (got + (rank, world)),
                                function="python")
        return comm
    if not _lib.has("sg_comm_create_xport"):
        raise UnsupportedError(
            "Comm.from_torch: a %s process group needs shardgrad's torch.distributed transport, "
            "which this libshardgrad lacks; start the job with mpirun instead of torchrun "
            "(from_torch then uses MPI), or create the communicator with Comm.mpi()" % backend,
            function="python")
    from . import _torch_xport
    return _torch_xport.create(g, rank, world)


def _nccl_from_torch(dist, g, rank, world):
    if not has_backend("nccl"):
        raise UnsupportedError("Comm.from_torch: the process group uses NCCL but this "
                               "libshardgrad was built without it (sg_has_backend('nccl'))",
                               function="python")
    uid = [Comm.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=dist.get_global_rank(g, 0), group=g)
    return Comm.nccl(rank, world, uid[0], cuda_device=torch.cuda.current_device())


# ------------------------------------------------------------------------------------------
# the optimizer


def _named_params(model):
    """[(name, param)] of a Module, of (name, param) pairs, or of bare parameters."""
    if isinstance(model, torch.nn.Module):
        return list(model.named_parameters())
    if isinstance(model, torch.Tensor):
        raise TypeError("ShardedAdamW: pass a Module or an iterable of parameters, not a Tensor")
    out = []
    for i, item in enumerate(model):
        if isinstance(item, dict):
            raise TypeError("ShardedAdamW: parameter groups must all be dicts, or none")
        if isinstance(item, tuple):
            out.append((str(item[0]), item[1]))
        else:
            out.append(("param%d" % i, item))
    return out


_GROUP_KEYS = ("lr", "weight_decay", "betas", "eps")


def _group_opts(group):
    if not isinstance(group, dict) or "params" not in group:
        raise TypeError("ShardedAdamW: a parameter group is a dict with 'params', got %r"
                        % (group,))
    return {k: v for k, v in group.items() if k != "params"}


def _group_params(group):
    ps = group["params"]
    if isinstance(ps, torch.Tensor):
        return [ps]
    return list(ps)


def _grouped_params(model, param_groups):
    """([(name, param)], [group index of each], [options of each group]) for torch-style
    groups given as `model` (a list of dicts) or as param_groups= over a model; None, None
    when there are no groups."""
    items = None
    if not isinstance(model, (torch.nn.Module, torch.Tensor)):
        items = list(model)
        if items and all(isinstance(g, dict) for g in items):
            if param_groups is not None:
                raise TypeError("ShardedAdamW: parameter groups given twice (as the first "
                                "argument and as param_groups=)")
            named, group_of, i = [], [], 0
            for g, grp in enumerate(items):
                for item in _group_params(grp):
                    named.append((str(item[0]), item[1]) if isinstance(item, tuple)
                                 else ("param%d" % i, item))
                    group_of.append(g)
                    i += 1
            return named, group_of, [_group_opts(grp) for grp in items]
    if param_groups is None:
        return None, None, None
    named = _named_params(model if items is None else items)
    index = {id(p): i for i, (_, p) in enumerate(named)}
    group_of = [None] * len(named)
    opts = []
    for g, grp in enumerate(param_groups):
        opts.append(_group_opts(grp))
        for item in _group_params(grp):
            p = item[1] if isinstance(item, tuple) else item
            if id(p) not in index:
                raise InvalidArgumentError("ShardedAdamW: param_groups[%d] holds a parameter "
                                           "that is not in the model" % g, function="python")
            if group_of[index[id(p)]] is not None:
                raise InvalidArgumentError("ShardedAdamW: a parameter is in two param_groups",
                                           function="python")
            group_of[index[id(p)]] = g
    if any(g is None for g in group_of):  # the rest: one more group, constructor's values
        group_of = [len(opts) if g is None else g for g in group_of]
        opts.append({})
    return named, group_of, opts


# ------------------------------------------------------------------------------------------
# which ShardedAdamW holds a parameter; torch.nn.utils.clip_grad_norm_ routed to it (opt-in)

_OWNER = {}  # id(parameter) -> weakref to the ShardedAdamW holding its gradient


def _check_unowned(named):
    """A parameter re-pointed to one engine's memory and hooked to hand its gradient there
    cannot serve a second one (it would step with a norm of 0 and overwrite the first's
    updates): refused before anything is built."""
    for name, p in named:
        opt = _owner_of(p)
        if opt is not None:
            raise InvalidArgumentError(
                "ShardedAdamW: parameter '%s' already belongs to another ShardedAdamW (%r); "
                "one optimizer per parameter: close() the other first, or give each optimizer "
                "its own parameters" % (name, opt), function="python")


def _register_params(opt):
    ref = weakref.ref(opt)
    for _, p in opt._named:
        _OWNER[id(p)] = ref


def _unregister_params(opt):
    for _, p in getattr(opt, "_named", []):
        r = _OWNER.get(id(p))
        if r is not None and r() in (opt, None):
            del _OWNER[id(p)]


def _owner_of(p):
    r = _OWNER.get(id(p))
    opt = r() if r is not None else None
    if opt is None or opt._closed or not any(q is p for _, q in opt._named):
        return None
    return opt


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                     foreach=None):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {}
    for p in params:
        opt = _owner_of(p)
        if opt is not None:
            owners[id(opt)] = opt
    if not owners:
        return _torch_clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                      error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    if len(owners) > 1:
        raise RuntimeError("torch.nn.utils.clip_grad_norm_: these parameters belong to %d "
                           "ShardedAdamW optimizers; their gradients live in the library: "
                           "call opt.clip_grad_norm_(max_norm) on each"
                           % len(owners))
    opt = next(iter(owners.values()))
    mine = {id(q) for _, q in opt._named}
    given = {id(p) for p in params}
    strays = [p for p in params if id(p) not in mine and p.grad is not None]
    if strays or mine - given:
        raise RuntimeError("torch.nn.utils.clip_grad_norm_: the parameters given are %s a "
                           "ShardedAdamW's; it clips the global norm of all of its gradients "
                           "(which live in the library), so pass exactly its "
                           "parameters, or call opt.clip_grad_norm_(max_norm)"
                           % ("more than" if strays else "only part of"))
    return opt.clip_grad_norm_(max_norm, norm_type=norm_type,
                               error_if_nonfinite=error_if_nonfinite)


_torch_clip_grad_norm_ = None


def patch_clip_grad_norm():
    """Opt-in: torch.nn.utils.clip_grad_norm_ (and torch.nn.utils.clip_grad's) are replaced,
    process-wide, by a function that sends a call on exactly the parameters of a live
    ShardedAdamW to opt.clip_grad_norm_ (the library computes the clip coefficient itself) and
    any other call to torch's, unchanged. Not needed for correct clipping: torch's own
    clip_grad_norm_ on the parameters reads the true global norm through p.grad (ShardGrad,
    docs/torch-grads.md) and clips. Idempotent."""
    global _torch_clip_grad_norm_
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as cg
    if getattr(nnu.clip_grad_norm_, "_shardgrad", False):
        return
    _torch_clip_grad_norm_ = nnu.clip_grad_norm_
    wrapper = functools.wraps(_torch_clip_grad_norm_)(_clip_grad_norm_)
    wrapper._shardgrad = True
    nnu.clip_grad_norm_ = wrapper
    if getattr(cg, "clip_grad_norm_", None) is _torch_clip_grad_norm_:
        cg.clip_grad_norm_ = wrapper


def _check_one_dtype(named):
    """One engine holds one working dtype: a model mixing dtypes would silently become all one
    dtype (and its forward fail inside torch), so it is refused by name."""
    first = {}
    for name, p in named:
        first.setdefault(p.dtype, name)
    if len(first) > 1:
        which = ", ".join("'%s' is %s" % (n, str(dt).replace("torch.", ""))
                          for dt, n in first.items())
        raise InvalidArgumentError(
            "ShardedAdamW: the parameters have %d dtypes (%s); one ShardedAdamW keeps one "
            "working dtype: cast the model to one (e.g. model.to(torch.bfloat16)), or give each "
            "dtype's parameters their own ShardedAdamW" % (len(first), which), function="python")
    sg_dtype(named[0][1].dtype)  # float32, bfloat16 or float16


MIN_BUCKET_BYTES = 64 << 10
MAX_BUCKET_BYTES = 32 << 20


def default_bucket_bytes(grad_bytes):
    """The bucket size ShardedAdamW picks for a model of grad_bytes gradient bytes: 1/8 of it,
    rounded up to 64 KiB, within 64 KiB..32 MiB (32 MiB, the library's default, from 256 MiB
    of gradients on). Eight buckets: the 2 staging buckets of SHARD_GRAD_OP then hold a quarter
    of the gradient (not all of it, as one bucket would, which is SHARD_OPT's cost), and the
    first bucket's reduction starts after an eighth of the backward pass. A parameter larger
    than a bucket gets a bucket of its own, so a model whose largest parameter exceeds half
    the gradient still stages it whole."""
    b = -(-int(grad_bytes) // 8)
    b = -(-b // MIN_BUCKET_BYTES) * MIN_BUCKET_BYTES
    return max(MIN_BUCKET_BYTES, min(MAX_BUCKET_BYTES, b))


def _f32_short(x):
    """The shortest decimal that rounds to the same float32 (0.1 rather than 0.10000000149)."""
    return float(str(np.float32(x)))


def _grad_hook(opt_ref, pid, param):
    opt = opt_ref()
    if opt is not None:
        opt._take_grad(pid, param)


def _drop_view_hook(opt_ref, i, grad):
    """Before autograd accumulates a new gradient into p.grad: a ShardGrad there stands for
    what the library holds already, so it leaves and the new gradient lands in .grad alone
    (then _take_grad hands it over)."""
    opt = opt_ref()
    if opt is not None:
        p = opt._named[i][1]
        if isinstance(p.grad, ShardGrad):
            p.grad = None


def _order_hook(opt_ref, indices, module, args):
    opt = opt_ref()
    if opt is not None and not opt._ready:
        opt._note_forward(indices)


def _wait_hook(opt_ref, indices, module, args):
    opt = opt_ref()
    if opt is not None:
        opt._wait_for(indices)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over shardgrad: sharded gradients, master weights and moments (ZeRO-2 by default).

    model: an nn.Module (names from named_parameters) or an iterable of parameters or
    (name, parameter) pairs; every rank must pass the same names and shapes.
    comm: a shardgrad.Comm (Comm.mpi() or one of Comm.local(n)).
    replica_comm: hybrid sharding across nodes: `comm` is then this rank's node (the shard
    communicator) and replica_comm its counterparts on the other nodes, as from
    `shard, replica = world.split_nodes(ranks_per_node)`; gradients and optimizer state are
    sharded inside the node, and only one all-reduce of the shard per step crosses nodes.
    On CUDA tensors NCCL inside and across nodes (split_nodes of an NCCL Comm) is the fast
    path; a host replica_comm (MPI) beside an NCCL comm goes through pinned host memory.
    lr, betas, eps, weight_decay: as torch.optim.AdamW; unset ones come from `config`, else
    the library defaults (1e-3, (0.9, 0.999), 1e-8, 0.01 as in torch.optim.AdamW).
    no_decay: None (every parameter decays, as in torch.optim.AdamW), "1d" (parameters with
    ndim <= 1 get no weight decay), a set of names, or a callable (name, param) -> bool that
    is True for the parameters that get none.
    broadcast: make every rank start from rank 0's values (sg_broadcast_params); default when
    the world has more than one rank.
    param_order: "registration" (finalize now, named_parameters order) or "backward"
    (finalize at the first gradient, parameters laid out in the reverse of the first forward
    pass's order); see the module text.
    config / **config_kwargs: any other shardgrad.Config field (strategy, max_grad_norm,
    bucket_bytes, param_dtype, timeout_ms, overlap_param_gather, ...). param_dtype defaults to
    the parameters' dtype (one dtype for all of them); bucket_bytes to 1/8 of the gradient
    (see the module text). overlap_param_gather=True: the all-gathers after step() overlap the
    next forward pass, each module's forward pre-hook waiting for its own parameters (see the
    module text; call wait_params() before reading parameters outside a forward pass).
    offload_optimizer=True: on CUDA tensors the fp32 master, the moments and the gradient
    accumulator live in pinned host memory and AdamW runs on the CPU (bitwise the same results;
    memory().host_bytes counts it); on CPU tensors it changes nothing.
    optim_state_dtype="q8": AdamW's m and v in blockwise 8 bits (2 bytes per parameter instead
    of 8; docs/optim-state-8bit.md), tensors below optim_state_min_numel elements (4096) kept
    in fp32; param_state() returns them decoded. Not with offload_optimizer on CUDA.
    """

    def __init__(self, model, comm, lr=None, betas=None, eps=None, weight_decay=None,
                 no_decay=None, broadcast=None, param_order="registration", config=None,
                 param_groups=None, replica_comm=None, **config_kwargs):
        if not isinstance(comm, Comm):
            raise TypeError("ShardedAdamW: comm must be a shardgrad.Comm, got %r" % (comm,))
        if replica_comm is not None and not isinstance(replica_comm, Comm):
            raise TypeError("ShardedAdamW: replica_comm must be a shardgrad.Comm or None, got %r"
                            % (replica_comm,))
        if param_order not in ("backward", "registration"):
            raise ValueError("ShardedAdamW: param_order must be 'backward' or 'registration' "
                             "(got %r)" % (param_order,))
        self._param_order = param_order
        all_named, group_of, opts = _grouped_params(model, param_groups)
        if all_named is None:
            all_named, group_of, opts = _named_params(model), None, [{}]
            group_of = [0] * len(all_named)
        if len(opts) > MAX_GROUPS:
            raise InvalidArgumentError("ShardedAdamW: %d parameter groups (at most %d)"
                                       % (len(opts), MAX_GROUPS), function="python")
        keep = [i for i, (_, p) in enumerate(all_named) if p.requires_grad and p.numel() > 0]
        named = [all_named[i] for i in keep]
        self._group_of = [group_of[i] for i in keep]  # engine group of each entry of _named
        if not named:
            raise InvalidArgumentError("ShardedAdamW: no trainable parameters", function="python")
        if len({id(p) for _, p in named}) != len(named):
            raise InvalidArgumentError("ShardedAdamW: a parameter is listed twice",
                                       function="python")
        _check_unowned(named)
        self._named = named
        self._engine = None
        self._hooks = []
        self._closed = False
        self._callback_queued = False
        self._handed = False  # gradients went to the library since the last step
        self._ready = False      # engine finalized, parameters adopted
        self._sync = True        # wanted sync state (no_sync may be entered before _ready)
        self._arrival = []       # indices in gradient arrival order, first backward only
        self._pid = [None] * len(named)  # index in _named -> engine parameter id
        if isinstance(no_decay, str) and no_decay != "1d":
            raise ValueError("ShardedAdamW: no_decay must be None, \"1d\", a set of names or a "
                             "callable (got %r)" % (no_decay,))
        self._no_decay = no_decay
        self._broadcast = broadcast
        self.last_step_info = None
        # Unset hyperparameters come from `config`, else from the library's defaults (which are
        # torch.optim.AdamW's: 1e-3, (0.9, 0.999), 1e-8, 0.01).
        src = config if config is not None else Config(validate=False)
        lr = _f32_short(src.lr) if lr is None else float(lr)
        betas = ((_f32_short(src.beta1), _f32_short(src.beta2)) if betas is None
                 else tuple(float(b) for b in betas))
        eps = _f32_short(src.eps) if eps is None else float(eps)
        weight_decay = (_f32_short(src.weight_decay) if weight_decay is None
                        else float(weight_decay))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        for g, o in enumerate(opts):
            for k in ("betas", "eps"):
                if k in o and (tuple(float(b) for b in o[k]) if k == "betas" else float(o[k])) \
                        != defaults[k]:
                    raise UnsupportedError("ShardedAdamW: param group %d sets its own %s; betas "
                                           "and eps are the same for every group (pass them to "
                                           "the constructor)" % (g, k), function="python")
        groups = [dict(o, params=[p for (_, p), gi in zip(named, self._group_of) if gi == g])
                  for g, o in enumerate(opts)]
        self._init_done = False
        super().__init__(groups, defaults)
        self._init_done = True
        self._fixed = self._group_hparams()
        self._sent = [None] * len(self.param_groups)  # (lr, wd) last given to the engine
        cfg = self._make_config(config, config_kwargs, named, lr, betas, eps, weight_decay)
        if cfg.overlap_param_gather and not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError("ShardedAdamW: overlap_param_gather needs an nn.Module "
                                       "(forward pre-hooks on its modules wait for the "
                                       "parameters)", function="python")
        self._engine = Engine(comm, cfg, replica_comm=replica_comm)
        # max_grad_norm as the caller's Python value (exact through sg_set_hparams)
        self._max_norm = (float(config_kwargs["max_grad_norm"]) if "max_grad_norm" in config_kwargs
                          else _f32_short(cfg.max_grad_norm))
        self._clip_once = None  # clip_grad_norm_'s max_norm for the coming step
        self._token = uuid.uuid4().hex  # state_dict() made by this optimizer ...
        self._version = 0  # ... at this state (steps and loads so far)
        _register_params(self)
        if isinstance(model, torch.nn.Module) and (self._engine.world_size > 1
                                                   or _dist_initialized()):
            # accelerate (transformers.Trainer) would wrap the model in DistributedDataParallel
            # (with any process group, even of one rank), which all-reduces .grad itself: this
            # optimizer already reduces every gradient
            model._is_accelerate_prepared = True
        # CUDA engine, several ranks as threads: no library call from torch's autograd thread
        # (see the module text); the gradients wait in .grad for step().
        cuda = self._engine.config.device == Device.CUDA
        self._defer = cuda and comm.kind == "local" and self._engine.world_size > 1
        self._stream = None     # CUDA: the torch stream the engine works on
        self._hand_order = []   # indices into _named, in gradient arrival (= plan) order
        ref = weakref.ref(self)
        self._grads = GradState(ref, len(named))  # what the p.grad ShardGrads stand for
        for i, (_, p) in enumerate(named):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(_grad_hook, ref, i)))
            self._hooks.append(p.register_hook(functools.partial(_drop_view_hook, ref, i)))
        self._wait_hooks = []   # forward pre-hooks (overlap_param_gather)
        self._unwaited = set()  # indices into _named whose all-gather may still be pending
        if self._engine.overlap_param_gather:
            self._add_wait_hooks(model, ref)
        self._order_hooks = []  # forward pre-hooks recording the first forward's order
        self._forward_seen = {}  # index into _named -> position of first use
        if param_order == "registration":
            self._setup(list(range(len(named))))
        elif isinstance(model, torch.nn.Module) and not self._defer:
            self._add_order_hooks(model, ref)

    # -- construction ---------------------------------------------------------------------
    @staticmethod
    def _make_config(config, kwargs, named, lr, betas, eps, weight_decay):
        kw = dict(kwargs)
        kw.update(lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps),
                  weight_decay=float(weight_decay))
        _check_one_dtype(named)
        if "param_dtype" not in kwargs and config is None:
            kw["param_dtype"] = sg_dtype(named[0][1].dtype)
        if "bucket_bytes" not in kwargs and config is None:
            kw["bucket_bytes"] = default_bucket_bytes(
                sum(p.numel() for _, p in named) * named[0][1].element_size())
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise InvalidArgumentError("ShardedAdamW: parameters on several devices %s"
                                       % sorted(map(str, devices)), function="python")
        dev = devices.pop()
        if "device" not in kwargs and config is None and dev.type == "cuda":
            kw["device"] = Device.CUDA
            kw.setdefault("cuda_device", dev.index if dev.index is not None else -1)
        if config is not None:
            return config.copy(**kw).validate()
        return Config(**kw)

    def _add_wait_hooks(self, model, ref):
        """overlap_param_gather: a forward pre-hook on every module that directly owns some of
        the parameters (a tied parameter counts for each module holding it) waits for the
        all-gather of those parameters only, so that each layer's forward overlaps the
        gathers of the layers after it."""
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        for m in model.modules():
            own = sorted({index[id(p)] for p in m.parameters(recurse=False) if id(p) in index})
            if own:
                self._wait_hooks.append(m.register_forward_pre_hook(
                    functools.partial(_wait_hook, ref, tuple(own))))

    def _add_order_hooks(self, model, ref):
        """param_order="backward": a forward pre-hook on every module that directly owns some
        of the parameters notes when the first forward pass first uses them (removed once the
        engine is built)."""
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        for m in model.modules():
            own = tuple(sorted({index[id(p)] for p in m.parameters(recurse=False)
                                if id(p) in index}))
            if own:
                self._order_hooks.append(m.register_forward_pre_hook(
                    functools.partial(_order_hook, ref, own)))

    def _note_forward(self, indices):
        for i in indices:
            self._forward_seen.setdefault(i, len(self._forward_seen))

    def _wait_for(self, indices):
        """Forward pre-hook: the parameters `indices` (into _named) are gathered before the
        module reads them (CUDA: torch's current stream waits, the host does not)."""
        todo = [i for i in indices if i in self._unwaited]
        if not todo or self._closed:
            return  # nothing pending since the last step (or no step yet)
        e = self._engine
        for i in todo:
            e.param_wait(self._pid[i])
            self._unwaited.discard(i)
        self._torch_waits()

    def wait_params(self):
        """overlap_param_gather: waits for every pending all-gather, for code that reads the
        parameters outside a forward pass of their modules (the hooks cover those). A no-op
        otherwise. close(), save(), state_dict() and the like wait by themselves."""
        if self._ready and not self._closed:
            self._engine.param_wait(-1)
            self._unwaited.clear()
            self._torch_waits()

    def _decays(self, name, p):
        nd = self._no_decay
        if nd is None:
            return True
        if isinstance(nd, str):
            return p.ndim > 1
        if callable(nd):
            return not nd(name, p)
        return name not in nd

    def _setup(self, registration):
        """Collective: registers the parameters in the given order (indices into _named),
        finalizes, loads the values and re-points every parameter to library memory. The plan
        lays parameters out in reverse registration order and reduces buckets in that order."""
        e = self._engine
        try:
            for i in registration:
                name, p = self._named[i]
                self._pid[i] = e.add_param(name, tuple(p.shape),
                                           no_decay=not self._decays(name, p))
                if self._group_of[i]:
                    e.set_param_group(self._pid[i], self._group_of[i])
            try:
                e.finalize()
            except MismatchError as ex:
                if (self._param_order != "backward"
                        or "registered different parameters" not in ex.message):
                    raise  # another rank failed, or configs differ: the order is not the cause
                raise MismatchError(ex.message + " (ShardedAdamW: with param_order='backward' "
                                    "every rank must use its modules in the same order in its "
                                    "first forward pass; otherwise use "
                                    "param_order='registration')",
                                    ex.status, ex.function) from None
            for i, (_, p) in enumerate(self._named):
                e.set_param(self._pid[i], p.detach().to("cpu"))
            broadcast = self._broadcast
            if broadcast is None:
                broadcast = e.world_size > 1
            if broadcast:
                e.broadcast_params(0)
            place = contextlib.nullcontext()
            if e.config.device == Device.CUDA:
                dev = e.config.cuda_device
                cur = torch.cuda.current_stream(dev if dev >= 0 else None)
                # handle 0 (torch's default stream) would mean "an internal stream"
                self._stream = cur if cur.cuda_stream != 0 else torch.cuda.Stream(cur.device)
                e.set_stream(self._stream)
                self._torch_waits()  # for the values set and broadcast above
                # the views are made on torch's current device: make it the engine's
                place = torch.cuda.device(self._stream.device)
            with place, torch.no_grad():
                for i, (_, p) in enumerate(self._named):
                    p.data = e.param_tensor(self._pid[i])
            self._note_versions()
            if not self._sync and not self._defer:
                e.set_sync(False)
        except BaseException:
            self._closed = True
            for h in self._hooks + self._wait_hooks + self._order_hooks:
                h.remove()
            self._hooks = []
            self._wait_hooks = []
            self._order_hooks = []
            e.close()
            raise
        self._hand_order = list(registration[::-1])
        self._ready = True
        for h in self._order_hooks:
            h.remove()
        self._order_hooks = []

    def _learned_order(self):
        """Registration order (the plan reduces in its reverse): the first forward pass's
        order of first use with the parameters it did not see first; else (deferred mode)
        reverse gradient arrival with the parameters that got none first; else
        named_parameters order."""
        n = len(self._named)
        if self._forward_seen:
            seen = sorted(self._forward_seen, key=self._forward_seen.get)
            return [i for i in range(n) if i not in self._forward_seen] + seen
        if not self._arrival:
            return list(range(n))
        seen = set(self._arrival)
        order = self._arrival + [i for i in range(n) if i not in seen]
        return order[::-1]

    def _ensure_ready(self):
        """Finalizes (in the order the gradients came, if any came) when not done yet."""
        if self._closed:
            raise InvalidStateError("ShardedAdamW is closed", function="python")
        if not self._ready:
            self._setup(self._learned_order())
            self._arrival = []

    def add_param_group(self, param_group):
        if getattr(self, "_init_done", True):
            raise UnsupportedError("ShardedAdamW: parameters are fixed at construction",
                                   function="python")
        super().add_param_group(param_group)

    # -- gradients ------------------------------------------------------------------------
    def _take_grad(self, i, p):
        g = p.grad
        if g is None or self._closed or isinstance(g, ShardGrad):
            return
        if self._grads.scaled or any(f != 1.0 for f in self._grads.pending):
            raise RuntimeError("ShardedAdamW: a gradient arrived after the step's gradients "
                               "were scaled in place (p.grad.mul_, clip_grad_norm_): clip "
                               "after the last backward of the step, or call zero_grad()")
        if g.is_sparse:
            raise UnsupportedError("ShardedAdamW: sparse gradients are not supported",
                                   function="python")
        if self._defer:
            # Kept in .grad for step(); the first gradients tell the order.
            if not self._ready and i not in self._arrival:
                self._arrival.append(i)
            return
        if not self._callback_queued:
            # Completes the micro-batch once the whole backward pass has run.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._callback_queued = True
        if not self._ready:
            # First gradient: build the engine now, before any other gradient exists.
            self._setup(self._learned_order())
        self._hand_over(i, g)
        self._handed = True
        p.grad = None

    def _hand_over(self, i, g):
        if g.dtype not in _TO_SG:
            g = g.float()
        if not g.is_contiguous():
            g = g.contiguous()
        if self._engine_waits():
            # g's memory must not be handed out again before the engine's stream has read it
            g.record_stream(self._stream)
        self._engine.grad_add_ptr(self._pid[i], g.data_ptr(), _TO_SG[g.dtype])

    def _engine_waits(self):
        """CUDA: the engine's stream waits for the work issued so far to the current stream
        (gradients, reads of the parameters). True when the two streams differ."""
        if self._stream is None:
            return False
        cur = torch.cuda.current_stream(self._stream.device)
        if cur == self._stream:
            return False
        self._stream.wait_stream(cur)
        return True

    def _torch_waits(self):
        """CUDA: the current stream waits for the engine's work so far (parameters written)."""
        if self._stream is None:
            return
        cur = torch.cuda.current_stream(self._stream.device)
        if cur != self._stream:
            cur.wait_stream(self._stream)

    def _hand_over_deferred(self):
        """Deferred mode (CUDA, ranks as threads): the gradients accumulated in .grad since the
        last step go to the library now, on this rank's own thread, as one micro-batch."""
        self._ensure_ready()
        handed = False
        for i in self._hand_order:
            p = self._named[i][1]
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise UnsupportedError("ShardedAdamW: sparse gradients are not supported",
                                           function="python")
                self._hand_over(i, p.grad)
                p.grad = None
                handed = True
        if handed:
            self._engine.backward_end()

    def _backward_end(self):
        self._callback_queued = False
        if not self._closed:
            self._engine.backward_end()
            self._show_grads()

    def _show_grads(self):
        """Every parameter's p.grad becomes a ShardGrad of the gradients the library now holds
        (docs/torch-grads.md); those of an earlier backward go stale."""
        st = self._grads
        st.gen += 1
        st.usable = None if self._sync else (
            "inside no_sync() the micro-batches are accumulated locally, not reduced yet: "
            "the step's gradients can be read after its last backward, outside no_sync()")
        for i, (name, p) in enumerate(self._named):
            p.grad = ShardGrad(p, st, i, name)

    def _drop_grads(self):
        """The gradients the ShardGrads stood for are gone (step, zero_grad, load, close)."""
        st = getattr(self, "_grads", None)
        if st is None:  # the constructor failed before
            return
        st.gen += 1
        st.pending = [1.0] * st.n
        st.scaled = False

    def _scale_grads(self, factor):
        """Every parameter's p.grad was scaled in place by `factor`: the library's gradients
        are (sg_grad_scale; a factor of 0 drops them, as sg_grad_zero does)."""
        self._live()
        if factor == 0.0:
            if self._handed:
                if not _lib.has("sg_grad_zero"):
                    raise UnsupportedError("ShardedAdamW: this libshardgrad has no "
                                           "sg_grad_zero, so p.grad cannot be zeroed; use "
                                           "opt.zero_grad()", function="python")
                self._engine.grad_zero()
                self._clip_once = None  # it was for the gradients just dropped
            self._handed = False
            self._grads.pending = [1.0] * self._grads.n
            return
        if not _lib.has("sg_grad_scale"):
            raise UnsupportedError("ShardedAdamW: this libshardgrad has no sg_grad_scale, so "
                                   "p.grad cannot be scaled; use opt.clip_grad_norm_(max_norm)",
                                   function="python")
        self._engine.grad_scale(factor)
        self._grads.scaled = True

    def grad_norm(self):
        """Collective, after the last backward of a step and before step(): the global L2 norm
        of the reduced gradient (after any in-place scaling of p.grad, before the step's own
        clipping), as a float; NaN or inf when it is not finite."""
        self._live()
        if self._defer:
            self._hand_over_deferred()
        self._ensure_ready()
        if not _lib.has("sg_grad_norm"):
            raise UnsupportedError("ShardedAdamW.grad_norm: this libshardgrad has no "
                                   "sg_grad_norm", function="python")
        self._engine_waits()
        return self._engine.grad_norm()

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate locally, without communication; the first backward
        after the block (with sync on) reduces everything. Enter and leave between
        micro-batches, on every rank alike."""
        if self._ready and not self._defer:  # deferred: torch accumulates in .grad
            self._live().set_sync(False)
        self._sync = False  # an engine built inside the block starts without sync
        try:
            yield
        finally:
            self._sync = True
            if self._ready and not self._defer and not self._closed:
                self._engine.set_sync(True)

    def zero_grad(self, set_to_none=True):
        """Drops the gradients since the last step, as torch's zero_grad does: any .grad left on
        the parameters, and those already handed to the library (Engine.grad_zero: a micro-batch
        cut short by an exception in backward is completed and thrown away with the rest), so a
        loop can catch the exception, call zero_grad() and carry on. Collective when gradients
        were handed over since the last step: then every rank calls it at the same point."""
        if self._handed and self._ready and not self._closed and _lib.has("sg_grad_zero"):
            self._engine.grad_zero()
            self._clip_once = None  # it was for the gradients just dropped
        self._drop_grads()
        self._handed = False
        # a backward that raised never ran its queued _backward_end
        self._callback_queued = False
        for _, p in self._named:
            p.grad = None

    def _note_versions(self):
        """torch's version counter of every parameter now that the library wrote it: the
        library's own writes (steps, loads) do not count, torch's in-place writes do."""
        self._pver = [p._version for _, p in self._named]

    def _sync_written(self):
        """bf16/f16 parameters written in place by torch since the library last wrote them
        (model.load_state_dict, p.copy_, p.fill_, clamping under no_grad: anything that bumps
        p._version) would be put back from the fp32 master at the next step: their written
        values become the master (sg_set_param, this rank's fragments). f32 parameters are
        their own master. Writes through p.data (a tensor with a version counter of its own)
        are not seen: call opt.params_written() after them."""
        e = self._engine
        if e is None or not self._ready or e.param_dtype == DType.F32:
            return
        for i, (_, p) in enumerate(self._named):
            if p._version != self._pver[i]:
                self._set_from_torch(i)

    def _set_from_torch(self, i):
        p = self._named[i][1]
        self._engine_waits()
        self._engine.set_param(self._pid[i], p.detach().to("cpu", copy=True))
        self._pver[i] = p._version

    def params_written(self):
        """After writing parameters in a way their version counter does not show (p.data.copy_,
        writes through a NumPy view): every parameter's current value becomes its master
        weight (sg_set_param; give every rank the same values). Writes through the parameter
        itself (load_state_dict, p.copy_ under no_grad) are noticed without it."""
        self._ensure_ready()
        for i in range(len(self._named)):
            self._set_from_torch(i)

    def _readopt(self):
        """Parameters whose storage was replaced since they were re-pointed to the library (a
        model.to("cpu:0"), as transformers.Trainer does, copies them; so does load_state_dict
        with assign=True) would no longer see the step's updates: their current values go to
        the library and they view its memory again."""
        e = self._engine
        for i, (name, p) in enumerate(self._named):
            if p.data_ptr() == e.param_ptr(self._pid[i]):
                continue
            if p.dtype != torch_dtype(e.param_dtype):
                raise InvalidStateError("ShardedAdamW: parameter '%s' became %s (the library "
                                        "holds %s); change dtypes before building the optimizer"
                                        % (name, p.dtype, torch_dtype(e.param_dtype)),
                                        function="python")
            self._engine_waits()
            e.set_param(self._pid[i], p.detach().to("cpu"))
            with torch.no_grad():
                p.data = e.param_tensor(self._pid[i])
            self._pver[i] = p._version

    # -- step -----------------------------------------------------------------------------
    def _group_hparams(self):
        groups = self.param_groups
        if not _lib.has("sg_set_group"):  # weight decay fixed too
            return [(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in groups]
        return [(tuple(g["betas"]), g["eps"]) for g in groups]

    def _apply_hparams(self):
        """Gives the engine each group's lr and weight decay where they changed: exactly, as the
        Python floats they are, with betas, eps and the step's max_grad_norm (sg_set_hparams),
        so that the step's scalars are formed as torch.optim.AdamW forms them."""
        e = self._engine
        if _lib.has("sg_set_hparams"):
            max_norm = self._max_norm if self._clip_once is None else self._clip_once
            for g, grp in enumerate(self.param_groups):
                b1, b2 = (float(b) for b in grp["betas"])
                v = (float(grp["lr"]), float(grp["weight_decay"]), b1, b2, float(grp["eps"]),
                     max_norm)
                if v != self._sent[g]:
                    e.set_hparams(g, lr=v[0], weight_decay=v[1], beta1=b1, beta2=b2, eps=v[4],
                                  max_grad_norm=max_norm)
                    self._sent[g] = v
            return
        for g, grp in enumerate(self.param_groups):
            v = (float(grp["lr"]), float(grp["weight_decay"]))
            if v == self._sent[g]:
                continue
            if _lib.has("sg_set_group"):
                e.set_group(g, v[0], v[1])
            elif v[0] != e.lr:
                e.set_lr(v[0])
            self._sent[g] = v

    @torch.no_grad()
    def step(self, closure=None):
        """Collective: reduction, clipping, AdamW on this rank's shard, all-gather of the
        updated parameters. Returns the closure's loss (if any); step info in last_step_info."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != len(self._sent):
            raise UnsupportedError("ShardedAdamW: parameter groups are fixed at construction",
                                   function="python")
        if self._group_hparams() != self._fixed:
            raise UnsupportedError("ShardedAdamW: only 'lr' and 'weight_decay' may change after "
                                   "construction (betas and eps are fixed)", function="python")
        if self._defer:
            self._hand_over_deferred()
        self._ensure_ready()
        self._readopt()
        self._sync_written()
        self._apply_hparams()
        self._grads.check_uniform("step()")
        self._engine_waits()  # the backward pass still reads the parameters AdamW overwrites
        self.last_step_info = self._engine.step()
        self._drop_grads()
        self._handed = False
        self._callback_queued = False  # the step completed any micro-batch left open
        self._version += 1
        self._clip_once = None
        if self._wait_hooks:  # overlap_param_gather: the gathers run on; the hooks wait
            self._unwaited = set(range(len(self._named)))
        self._torch_waits()
        return loss

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """Collective, after the last backward of a step and before step(): torch's
        clip_grad_norm_ for the gradients the library holds. Returns the global L2 norm of the
        reduced gradient before clipping (a 0-d float32 tensor, as torch does), and makes the
        coming step() clip to max_norm (coefficient min(1, max_norm / (norm + 1e-6)), torch's);
        max_norm = inf only reads the norm (the step then clips by the constructor's
        max_grad_norm, if any). torch.nn.utils.clip_grad_norm_ on this optimizer's parameters
        comes here. Only the L2 norm (norm_type 2)."""
        if float(norm_type) != 2.0:
            raise UnsupportedError("ShardedAdamW.clip_grad_norm_: only norm_type=2 (got %r)"
                                   % (norm_type,), function="python")
        max_norm = float(max_norm)
        if not max_norm >= 0.0:
            raise InvalidArgumentError("ShardedAdamW.clip_grad_norm_: max_norm must be >= 0 "
                                       "(got %r)" % (max_norm,), function="python")
        if not _lib.has("sg_grad_norm"):
            raise UnsupportedError("ShardedAdamW.clip_grad_norm_: this libshardgrad has no "
                                   "sg_grad_norm; pass max_grad_norm= to ShardedAdamW instead",
                                   function="python")
        self._live()
        if self._defer:
            self._hand_over_deferred()
        self._ensure_ready()
        self._grads.check_uniform("clip_grad_norm_")
        if max_norm != float("inf"):
            self._clip_once = max_norm
        self._apply_hparams()
        norm = self.grad_norm()
        if error_if_nonfinite and not np.isfinite(norm):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and "
                               "scale the gradients by the non-finite norm anyway, set "
                               "`error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=torch.float32)

    # -- state ----------------------------------------------------------------------------
    @property
    def engine(self):
        return self._engine

    @property
    def lr(self):
        return float(self.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value):
        for g in self.param_groups:
            g["lr"] = float(value)

    def _live(self):
        if self._closed:
            raise InvalidStateError("ShardedAdamW is closed", function="python")
        return self._engine

    @property
    def loss_scale(self):
        return self._live().loss_scale

    @property
    def step_count(self):
        """Optimizer steps taken (restored by load())."""
        self._ensure_ready()
        return self._engine.step_count

    def scale_loss(self, loss):
        """loss * current loss scale (only differs from loss for fp16 dynamic scaling)."""
        s = self._live().loss_scale
        return loss if s == 1.0 else loss * s

    def memory(self):
        self._ensure_ready()
        return self._engine.memory()

    def param_id(self, p):
        """Engine id of parameter p (after the first backward or step)."""
        self._ensure_ready()
        for i, (_, q) in enumerate(self._named):
            if q is p:
                return self._pid[i]
        raise KeyError("not a parameter of this optimizer")

    def master_weights(self):
        """Collective: {name: fp32 tensor} of the full master weights."""
        self._ensure_ready()
        self._sync_written()
        e = self._engine
        return {n: torch.from_numpy(e.get_master(self._pid[i]))
                for i, (n, _) in enumerate(self._named)}

    def param_state(self, p):
        """Collective: {'step', 'exp_avg', 'exp_avg_sq', 'master'} of parameter p (fp32)."""
        e, pid = self._engine, self.param_id(p)
        self._sync_written()
        if _lib.has("sg_get_param_step"):
            step = e.param_step(pid)  # skipped steps (no gradient) do not count, as in torch
        elif _lib.has("sg_get_step"):
            step = e.step_count
        else:
            step = self.last_step_info.step if self.last_step_info else 0
        return {"step": torch.tensor(float(step)),
                "exp_avg": torch.from_numpy(e.get_optim_state(pid, 0)),
                "exp_avg_sq": torch.from_numpy(e.get_optim_state(pid, 1)),
                "master": torch.from_numpy(e.get_master(pid))}

    def state_dict(self):
        """Collective: torch.optim-style dict; 'state' holds full (gathered) fp32 tensors."""
        state = {i: self.param_state(p) for i, (_, p) in enumerate(self._named)}
        groups = []
        for gi, g in enumerate(self.param_groups):
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [i for i, x in enumerate(self._group_of) if x == gi]
            groups.append(d)
        return {"state": state, "param_groups": groups,
                "names": [n for n, _ in self._named],
                "shardgrad": {"token": self._token, "version": self._version}}

    def load_state_dict(self, state_dict):
        """Takes back a state_dict() of this optimizer made since its last step (as
        accelerate, and so transformers.Trainer, does when it wraps an optimizer: state_dict,
        moved to the device, load_state_dict): the moments are those the library holds, and
        the param groups' hyperparameters are taken. Any other state (another optimizer's, an
        older one) needs setters the C API lacks: use save()/load()."""
        mark = state_dict.get("shardgrad") if isinstance(state_dict, dict) else None
        if (mark != {"token": self._token, "version": self._version}
                or state_dict.get("names") != [n for n, _ in self._named]
                or len(state_dict.get("param_groups", ())) != len(self.param_groups)):
            raise UnsupportedError("ShardedAdamW.load_state_dict: only this optimizer's own "
                                   "current state_dict() can be loaded (the C API has no setter "
                                   "for AdamW moments); use save()/load() (sharded checkpoints)",
                                   function="python")
        for mine, theirs in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def save(self, directory):
        """Collective: sharded checkpoint of parameters, masters, moments, step, lr and loss
        scale (sg_save); crash-safe. Call between steps."""
        self._ensure_ready()
        self._sync_written()
        self._engine.save(directory)
        if self._engine.rank == 0:
            self._write_shapes(directory)

    _SHAPES = "torch_shapes.json"  # beside sg_save's files: the shapes the library lacks

    def _write_shapes(self, directory):
        """The parameters' torch shapes, by name, for load() to check (the library's manifest
        has numels only). A new file in the directory (O_EXCL), renamed into place."""
        shapes = {n: list(p.shape) for n, p in self._named}
        fd, tmp = tempfile.mkstemp(prefix=".torch_shapes.", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(shapes, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, self._SHAPES))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _check_shapes(self, directory):
        """load() refuses a checkpoint whose parameter of the same name has another shape (the
        same numel would load silently reshaped), as torch's load_state_dict does. Checkpoints
        without the shapes (made by C callers) are checked by the library for numels only."""
        path = os.path.join(directory, self._SHAPES)
        if not os.path.isfile(path):
            return
        with open(path) as f:
            saved = json.load(f)
        bad = ["'%s': %s in the checkpoint, %s here" % (n, saved[n], list(p.shape))
               for n, p in self._named if n in saved and list(saved[n]) != list(p.shape)]
        if bad:
            raise MismatchError("ShardedAdamW.load(%r): parameter shapes differ: %s (torch's "
                                "load_state_dict refuses this too)"
                                % (directory, "; ".join(bad[:5]) + (" ..." if len(bad) > 5
                                                                    else "")),
                                function="python")

    def load(self, directory):
        """Collective: restores a save() made at any world size, bucket size or strategy; the
        model's parameters change in place. The learning rate stays param_groups' (the
        scheduler's): it is applied again at the next step."""
        self._ensure_ready()
        self._check_shapes(directory)
        self._engine_waits()
        self._engine.load(directory)
        self._note_versions()  # the library's write: the loaded masters stand
        self._drop_grads()
        self._version += 1
        self._torch_waits()
        self._sent = [None] * len(self.param_groups)  # lr and weight decay apply again
        self.last_step_info = None

    def export(self, path):
        """Collective (rank 0 writes): fp32 master weights by parameter name, safetensors."""
        self._ensure_ready()
        self._sync_written()
        self._engine.export(path)

    def import_(self, path):
        """Collective: sets the parameters from a safetensors file by name (optimizer state
        unchanged)."""
        self._ensure_ready()
        self._engine_waits()
        self._engine.import_(path)
        self._note_versions()  # the library's write: the loaded masters stand
        self._torch_waits()

    # -- teardown -------------------------------------------------------------------------
    def close(self):
        """Copies the parameters back into torch-owned memory, removes the hooks and lets the
        engine go: at once, or when the last tensor that still views the library's memory (a
        p.detach() made earlier, autograd's saved tensors) is gone. The model stays usable;
        the optimizer does not. After a communication failure it still closes (the parameters
        keep whatever the failed step left in them)."""
        if self._closed:
            return
        self._closed = True
        _unregister_params(self)
        self._drop_grads()
        for _, p in self._named:
            if isinstance(p.grad, ShardGrad):
                p.grad = None
        for h in (self._hooks + getattr(self, "_wait_hooks", [])
                  + getattr(self, "_order_hooks", [])):
            h.remove()
        self._hooks = []
        self._wait_hooks = []
        self._order_hooks = []
        e, self._engine = self._engine, None
        if e is None or e.closed:
            return
        if not self._ready:
            e.close()  # no view of its memory was ever made
            return
        try:
            e.param_wait(-1)  # overlap_param_gather: the copies need every bucket
        except ShardgradError:
            pass  # a broken engine (a peer failed): copy the parameters as they are
        self._torch_waits()  # the copies read what the engine's stream last wrote
        with torch.no_grad():
            for _, p in self._named:
                p.data = p.data.clone()
        # Views made before (they hold the Engine object) keep it alive; without any, this
        # was the last reference and the engine is destroyed here.
        e.release()

    def __reduce_ex__(self, protocol):
        # The default would copy the Python fields without the engine behind them (an object
        # that fails at step()): refused, for pickle, copy.copy and copy.deepcopy alike.
        raise TypeError("ShardedAdamW cannot be pickled or copied (its state lives in the "
                        "library, sharded over the ranks): use opt.state_dict() for a "
                        "gathered copy of the state, or opt.save(dir) / opt.load(dir) for "
                        "checkpoints")

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    def __copy__(self):
        self.__reduce_ex__(2)

    def __del__(self):
        if "_named" not in self.__dict__:
            return  # a wrapper sharing this class (see _on_real): the optimizer is not its own
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._engine is None or self._engine.closed or self._closed:
            return "ShardedAdamW(closed)"
        c = self._engine.config
        return ("ShardedAdamW(%d params, rank %d of %d, %s, lr=%g)"
                % (len(self._named), self._engine.rank, self._engine.world_size,
                   c.strategy.name, self.lr))


def _on_real(fn):
    """Lightning's LightningOptimizer wraps an optimizer in an object whose class derives from
    the optimizer's own (so isinstance holds) and whose attributes come from it through
    __getattr__: ShardedAdamW's methods, called on that wrapper, would set their state on the
    wrapper instead (and its __del__ would close the optimizer). They run on the wrapped
    ShardedAdamW instead."""
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        d = self.__dict__
        if "_named" not in d and isinstance(d.get("_optimizer"), ShardedAdamW):
            self = d["_optimizer"]
        return fn(self, *args, **kwargs)
    return method


for _name in ("step", "zero_grad", "close", "clip_grad_norm_", "grad_norm", "no_sync", "load",
              "save", "state_dict", "load_state_dict", "export", "import_", "wait_params",
              "params_written",
              "param_state", "master_weights", "memory", "param_id", "scale_loss"):
    setattr(ShardedAdamW, _name, _on_real(getattr(ShardedAdamW, _name)))
del _name
