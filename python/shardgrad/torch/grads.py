"""The `.grad` of a ShardedAdamW parameter: a tensor whose values live sharded in the library
(docs/torch-grads.md).

After each backward pass every parameter of a ShardedAdamW gets `p.grad` = a ShardGrad: a
wrapper tensor (torch.Tensor._make_wrapper_subclass, as DTensor is) with the parameter's shape,
dtype and device, standing for the reduced, averaged gradient of the step so far, which only the
library holds (each rank its shard). It answers what gradient clipping and norm logging do:

 - torch.linalg.vector_norm(g) / g.norm() / torch._foreach_norm: a GradNorm, a 0-d tensor that
   stands for that parameter's norm. Stacked (torch.stack, as torch.nn.utils.get_total_norm
   does) with the GradNorms of *every* parameter of the optimizer (and any plain tensors), the
   vector norm of the stack is a plain tensor: the true global L2 norm (sg_grad_norm, one
   collective). A single parameter's norm, or the norm of part of the parameters, cannot be
   read (the library keeps no per-parameter norms): that raises.
 - g.mul_(c), g.div_(c), torch._foreach_mul_(grads, c), g.zero_() with a number or a plain 0-d
   tensor: recorded; once every parameter's gradient carries the same factor, the library scales
   the step's gradient by it (sg_grad_scale; a factor of 0: sg_grad_zero), which is how
   torch.nn.utils.clip_grad_norm_ and clip_grads_with_norm_ clip.
 - detach(), .data, alias: the same gradient.
Anything else (reading values, .sum(), .clone(), .to(), indexing, arithmetic that makes a new
tensor, copy_, clamp_) raises a RuntimeError that says what to use instead: never a silently
wrong value.
"""

import math

import torch

__all__ = ["ShardGrad", "GradNorm"]

_HELP = ("the gradients of a ShardedAdamW live sharded in the library; p.grad supports "
         "torch.nn.utils.clip_grad_norm_ / get_total_norm / clip_grads_with_norm_ over all of "
         "the optimizer's parameters (norms, in-place mul_/div_/zero_ by a number), or use "
         "opt.grad_norm() and opt.clip_grad_norm_(max_norm); see docs/torch-grads.md")


class GradState:
    """Per optimizer: which generation of gradients the ShardGrads stand for, and the factors
    of in-place scaling not yet given to the library (one per parameter)."""

    def __init__(self, opt, n):
        self.opt = opt          # a weakref.ref to the ShardedAdamW
        self.n = n
        self.gen = 0            # bumped when the gradients change (backward, step, zero_grad)
        self.usable = None      # None: the grads can be read; else why not
        self.pending = [1.0] * n
        self.scaled = False     # a factor was applied since the last step

    def live(self, gen, what):
        if gen != self.gen:
            raise RuntimeError("ShardedAdamW: this .grad is stale (the optimizer stepped, or "
                               "zero_grad/another backward came since it was made): read "
                               "p.grad again (%s)" % what)
        if self.usable is not None:
            raise RuntimeError("ShardedAdamW: %s: %s" % (what, self.usable))
        opt = self.opt()
        if opt is None or opt._closed:
            raise RuntimeError("ShardedAdamW: %s: the optimizer is closed" % what)
        return opt

    def scale(self, indices, factor):
        """In-place scaling of the gradients `indices` by factor; given to the library as soon
        as every parameter carries the same factor."""
        for i in indices:
            self.pending[i] *= factor
        first = self.pending[0]
        if first != 1.0 and all(f == first for f in self.pending):
            opt = self.opt()
            self.pending = [1.0] * self.n
            opt._scale_grads(first)

    def check_uniform(self, what):
        if any(f != 1.0 for f in self.pending):
            raise RuntimeError("ShardedAdamW: %s: the gradients of only some parameters were "
                               "scaled in place (mul_/div_/zero_); the library scales the "
                               "gradients of all of them alike: scale every parameter's .grad "
                               "by the same factor" % what)


def _factor(c, what):
    if isinstance(c, (ShardGrad, GradNorm)):
        raise RuntimeError("ShardedAdamW: %s by a gradient or a norm that lives in the library "
                           "(%s)" % (what, _HELP))
    if isinstance(c, torch.Tensor):
        if c.numel() != 1:
            raise RuntimeError("ShardedAdamW: %s of p.grad by a tensor of %d elements: only by "
                               "a number or a 0-d tensor (%s)" % (what, c.numel(), _HELP))
        c = c.item()
    c = float(c)
    if not math.isfinite(c):
        raise RuntimeError("ShardedAdamW: %s of p.grad by a non-finite factor %r" % (what, c))
    return c


class ShardGrad(torch.Tensor):
    """p.grad of a ShardedAdamW parameter (see the module text)."""

    @staticmethod
    def __new__(cls, param, state, index, name):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype,
                                                device=param.device, requires_grad=False)
        t._sg_state, t._sg_index, t._sg_gen, t._sg_name = state, index, state.gen, name
        return t

    def _same(self):
        return ShardGrad.__new__(ShardGrad, self, self._sg_state, self._sg_index, self._sg_name)

    def __repr__(self, *, tensor_contents=None):
        return ("ShardGrad(shape=%s, dtype=%s, device=%s, param=%r: the reduced gradient, "
                "sharded in shardgrad)" % (list(self.shape), self.dtype, self.device,
                                            self._sg_name))

    def __reduce_ex__(self, protocol):
        raise TypeError("ShardedAdamW's p.grad cannot be pickled: " + _HELP)

    def numpy(self, *args, **kwargs):
        raise RuntimeError("ShardedAdamW: p.grad.numpy(): " + _HELP)

    def tolist(self):
        raise RuntimeError("ShardedAdamW: p.grad.tolist(): " + _HELP)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _GRAD_OPS.get(func)
        if handler is None:
            raise RuntimeError("ShardedAdamW: %s is not supported on p.grad: %s"
                               % (func, _HELP))
        return handler(*args, **kwargs)


class GradNorm(torch.Tensor):
    """The L2 norm of some ShardGrads (an index set of one optimizer) and of plain norms, as a
    0-d tensor (one parameter's norm) or a 1-d stack of such: only its vector norm over every
    parameter of the optimizer can be read."""

    @staticmethod
    def __new__(cls, state, gen, indices, plain, shape, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                requires_grad=False)
        t._sg_state, t._sg_gen, t._sg_indices, t._sg_plain = state, gen, indices, plain
        return t

    def __repr__(self, *, tensor_contents=None):
        return ("GradNorm(%d of %d ShardedAdamW parameters: readable only as the norm over all "
                "of them)" % (len(self._sg_indices), self._sg_state.n))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _NORM_OPS.get(func)
        if handler is None:
            raise RuntimeError("ShardedAdamW: %s on the norm of a p.grad: a parameter's own "
                               "gradient norm is not available (the library keeps the global "
                               "one only): take the vector norm of the stacked norms of all of "
                               "the optimizer's parameters (torch.nn.utils.get_total_norm), or "
                               "use opt.grad_norm()" % (func,))
        return handler(*args, **kwargs)


# -- the gradient's operations ----------------------------------------------------------------

def _check_norm_args(g, ord, dim, keepdim):
    if float(ord) != 2.0:
        raise RuntimeError("ShardedAdamW: a %r-norm of p.grad is not available, only the L2 norm "
                           "(norm_type=2)" % (ord,))
    if keepdim or (dim is not None and sorted(d % max(g.dim(), 1) for d in (
            [dim] if isinstance(dim, int) else dim)) != list(range(g.dim()))):
        raise RuntimeError("ShardedAdamW: a norm of p.grad along some dimensions is not "
                           "available, only over all elements: " + _HELP)


def _norm_of(g, dtype=None):
    st = g._sg_state
    st.live(g._sg_gen, "the norm of p.grad")
    return GradNorm.__new__(GradNorm, st, st.gen, frozenset([g._sg_index]), (), (),
                            dtype or g.dtype, g.device)


def _vector_norm(g, ord=2, dim=None, keepdim=False, *, dtype=None):
    _check_norm_args(g, ord, dim, keepdim)
    return _norm_of(g, dtype)


def _norm_scalar(g, p=2):
    return _vector_norm(g, 2 if p is None else p)


def _norm_dim(g, p, dim, keepdim=False, dtype=None):
    return _vector_norm(g, 2 if p is None else p, dim, keepdim, dtype=dtype)


def _foreach_norm(grads, ord=2, dtype=None):
    out = []
    for g in grads:
        if not isinstance(g, ShardGrad):
            out.append(torch.linalg.vector_norm(g, ord, dtype=dtype))
        else:
            out.append(_vector_norm(g, ord, dtype=dtype))
    return out


def _scale_one(g, factor, what):
    g._sg_state.live(g._sg_gen, what)
    g._sg_state.scale([g._sg_index], factor)
    return g


def _mul_(g, c):
    return _scale_one(g, _factor(c, "mul_"), "p.grad.mul_")


def _div_(g, c, rounding_mode=None):
    if rounding_mode is not None:
        raise RuntimeError("ShardedAdamW: div_ of p.grad with rounding_mode: " + _HELP)
    c = _factor(c, "div_")
    if c == 0:
        raise RuntimeError("ShardedAdamW: p.grad.div_(0)")
    return _scale_one(g, 1.0 / c, "p.grad.div_")


def _zero_(g):
    return _scale_one(g, 0.0, "p.grad.zero_")


def _foreach_scale(grads, factors, what):
    mine = {}
    for g, f in zip(grads, factors):
        if isinstance(g, ShardGrad):
            g._sg_state.live(g._sg_gen, what)
            mine.setdefault(id(g._sg_state), (g._sg_state, []))[1].append((g._sg_index, f))
        else:
            g.mul_(f)
    for st, items in mine.values():
        for i, f in items:  # one factor for all of them gives one library call
            st.pending[i] *= f
        st.scale([], 1.0)


def _factors(grads, c, what):
    if isinstance(c, (list, tuple)):
        if len(c) != len(grads):
            raise RuntimeError("ShardedAdamW: %s with %d factors for %d tensors"
                               % (what, len(c), len(grads)))
        return [_factor(x, what) for x in c]
    return [_factor(c, what)] * len(grads)


def _foreach_mul_(grads, c):
    _foreach_scale(grads, _factors(grads, c, "_foreach_mul_"), "torch._foreach_mul_")


def _foreach_div_(grads, c):
    fs = _factors(grads, c, "_foreach_div_")
    if any(f == 0 for f in fs):
        raise RuntimeError("ShardedAdamW: torch._foreach_div_ of p.grad by 0")
    _foreach_scale(grads, [1.0 / f for f in fs], "torch._foreach_div_")


def _foreach_zero_(grads):
    _foreach_scale(grads, [0.0] * len(grads), "torch._foreach_zero_")


def _alias(g, *rest, **kw):
    g._sg_state.live(g._sg_gen, "p.grad.detach()")
    return g._same()


def _requires_grad_(g, flag=True):
    if flag:
        raise RuntimeError("ShardedAdamW: p.grad.requires_grad_(True): " + _HELP)
    return g


_A = torch.ops.aten
_GRAD_OPS = {
    _A.linalg_vector_norm.default: _vector_norm,
    _A.norm.Scalar: _norm_scalar,
    _A.norm.ScalarOpt_dim: _norm_dim,
    _A._foreach_norm.Scalar: _foreach_norm,
    _A.mul_.Tensor: _mul_, _A.mul_.Scalar: _mul_,
    _A.div_.Tensor: _div_, _A.div_.Scalar: _div_, _A.div_.Tensor_mode: _div_,
    _A.zero_.default: _zero_,
    _A._foreach_mul_.Tensor: _foreach_mul_, _A._foreach_mul_.Scalar: _foreach_mul_,
    _A._foreach_mul_.ScalarList: _foreach_mul_,
    _A._foreach_div_.Tensor: _foreach_div_, _A._foreach_div_.Scalar: _foreach_div_,
    _A._foreach_div_.ScalarList: _foreach_div_,
    _A._foreach_zero_.default: _foreach_zero_,
    _A.detach.default: _alias, _A.alias.default: _alias,
}


# -- the norms' operations --------------------------------------------------------------------

def _norm_to(n, *args, dtype=None, device=None, **kw):
    return GradNorm.__new__(GradNorm, n._sg_state, n._sg_gen, n._sg_indices, n._sg_plain,
                            n.shape, dtype or n.dtype, device or n.device)


def _stack(items, dim=0):
    state, gen, indices, plain = None, None, set(), []
    dtype = device = None
    for t in items:
        dtype, device = dtype or t.dtype, device or t.device
        if t.dim() != 0:
            raise RuntimeError("ShardedAdamW: torch.stack of gradient norms that are not 0-d: "
                               "only the stack of per-parameter norms (get_total_norm) is "
                               "supported")
        if not isinstance(t, GradNorm):
            plain.append(t)
            continue
        if state is not None and t._sg_state is not state:
            raise RuntimeError("ShardedAdamW: the gradients of several ShardedAdamW optimizers "
                               "in one norm: take each optimizer's norm on its own "
                               "(opt.grad_norm()) and combine them")
        state, gen = t._sg_state, t._sg_gen
        if indices & t._sg_indices:
            raise RuntimeError("ShardedAdamW: a parameter's gradient twice in one norm")
        indices |= t._sg_indices
        plain.extend(t._sg_plain)
    return GradNorm.__new__(GradNorm, state, gen, frozenset(indices), tuple(plain),
                            (len(items),), dtype, device)


def _total(n, ord=2, dim=None, keepdim=False, *, dtype=None):
    """The vector norm of a stack of norms: sqrt(global norm^2 + plain norms^2) when the stack
    holds every parameter of the optimizer."""
    if float(ord) != 2.0 or keepdim or dim not in (None, 0, [0], (0,), -1, [-1], (-1,)):
        raise RuntimeError("ShardedAdamW: only the L2 norm over all of a stack of gradient "
                           "norms is available (norm_type=2)")
    st = n._sg_state
    opt = st.live(n._sg_gen, "the gradient norm")
    if len(n._sg_indices) != st.n:
        raise RuntimeError("ShardedAdamW: a norm over the gradients of only part of a "
                           "ShardedAdamW's parameters (%d of %d) is not available; the library "
                           "keeps the global norm: pass all of the optimizer's parameters, or "
                           "call opt.clip_grad_norm_(max_norm) / opt.grad_norm()"
                           % (len(n._sg_indices), st.n))
    st.check_uniform("the gradient norm")
    total = float(opt.grad_norm())
    if n._sg_plain:
        rest = torch.linalg.vector_norm(torch.stack([p.to(torch.float64).cpu()
                                                     for p in n._sg_plain]))
        total = math.sqrt(total * total + float(rest) ** 2)
    return torch.tensor(total, dtype=dtype or n.dtype, device=n.device)


def _norm_alias(n, *rest, **kw):
    return n


_NORM_OPS = {
    _A._to_copy.default: _norm_to,
    _A.stack.default: _stack,
    _A.linalg_vector_norm.default: _total,
    _A.detach.default: _norm_alias, _A.alias.default: _norm_alias,
}
