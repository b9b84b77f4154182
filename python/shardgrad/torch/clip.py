"""Which ShardedAdamW holds a parameter, and the opt-in replacement of
torch.nn.utils.clip_grad_norm_ that routes a call on an optimizer's parameters to it.

Nothing here is installed by ShardedAdamW: torch's clip_grad_norm_ already clips correctly
through the ShardGrads in p.grad (docs/torch-grads.md). patch_clip_grad_norm() replaces it,
process-wide, for code that wants the optimizer's own path (the clip coefficient computed by
the library) or its checks (a call on part of an optimizer's parameters raises).
"""

import functools
import weakref

import torch

from ..errors import InvalidArgumentError

__all__ = ["patch_clip_grad_norm", "check_unowned", "register_params", "unregister_params",
           "owner_of"]

_OWNER = {}  # id(parameter) -> weakref to the ShardedAdamW holding its gradient


def check_unowned(named):
    """A parameter re-pointed to one engine's memory and hooked to hand its gradient there
    cannot serve a second one (it would step with a norm of 0 and overwrite the first's
    updates): refused before anything is built."""
    for name, p in named:
        opt = owner_of(p)
        if opt is not None:
            raise InvalidArgumentError(
                "ShardedAdamW: parameter '%s' already belongs to another ShardedAdamW (%r); "
                "one optimizer per parameter: close() the other first, or give each optimizer "
                "its own parameters" % (name, opt), function="python")


def register_params(opt):
    ref = weakref.ref(opt)
    for _, p in opt._named:
        _OWNER[id(p)] = ref


def unregister_params(opt):
    for _, p in getattr(opt, "_named", []):
        r = _OWNER.get(id(p))
        if r is not None and r() in (opt, None):
            del _OWNER[id(p)]


def owner_of(p):
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
        opt = owner_of(p)
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
