"""The hooks ShardedAdamW puts on torch: per parameter, autograd hooks that hand each
gradient to the library; per module, forward pre-hooks that note the first forward's order
(param_order="backward") or wait for a bucket's all-gather (overlap_param_gather).

Each hook holds the optimizer through a weak reference (a model must not keep its optimizer
alive) and calls one method of it; nothing here imports the optimizer.
"""

import functools
import weakref

from .grads import ShardGrad

__all__ = ["add_grad_hooks", "add_order_hooks", "add_wait_hooks"]


def add_grad_hooks(opt):
    """Per parameter: a post-accumulate-grad hook that hands the gradient over (opt._take_grad)
    and a tensor hook that first removes a ShardGrad from p.grad. Returns the handles."""
    ref = weakref.ref(opt)
    hooks = []
    for i, (_, p) in enumerate(opt._named):
        hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_grad_hook, ref, i)))
        hooks.append(p.register_hook(functools.partial(_drop_view_hook, ref, i)))
    return hooks


def add_wait_hooks(opt, model):
    """overlap_param_gather: a forward pre-hook on every module that directly owns some of the
    parameters (a tied parameter counts for each module holding it) waits for the all-gather
    of those parameters only, so that each layer's forward overlaps the gathers of the layers
    after it. Returns the handles."""
    return _module_pre_hooks(opt, model, _wait_hook)


def add_order_hooks(opt, model):
    """param_order="backward": a forward pre-hook on every module that directly owns some of
    the parameters notes when the first forward pass first uses them (removed once the engine
    is built). Returns the handles."""
    return _module_pre_hooks(opt, model, _order_hook)


def _module_pre_hooks(opt, model, hook):
    """hook(opt_ref, indices, module, args) before the forward of every module of `model` that
    directly owns parameters of opt (indices into opt._named)."""
    ref = weakref.ref(opt)
    index = {id(p): i for i, (_, p) in enumerate(opt._named)}
    handles = []
    for m in model.modules():
        own = tuple(sorted({index[id(p)] for p in m.parameters(recurse=False) if id(p) in index}))
        if own:
            handles.append(m.register_forward_pre_hook(functools.partial(hook, ref, own)))
    return handles


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
