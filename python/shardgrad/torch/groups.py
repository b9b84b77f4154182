"""ShardedAdamW's parameters: which tensors it takes, their names, and torch-style parameter
groups (a list of dicts, or param_groups= over a model)."""

import torch

from .._structs import MAX_GROUPS
from ..errors import InvalidArgumentError, UnsupportedError
from .dtypes import sg_dtype

__all__ = ["select_params", "check_one_dtype", "check_shared_hparams"]


def select_params(model, param_groups):
    """([(name, param)], [group of each], [options of each group]) of the parameters the
    optimizer takes: the trainable, non-empty ones of `model` (a Module, parameters, (name,
    parameter) pairs, or torch-style group dicts), each once, in at most MAX_GROUPS groups."""
    all_named, group_of, opts = _grouped_params(model, param_groups)
    if all_named is None:
        all_named = _named_params(model)
        group_of, opts = [0] * len(all_named), [{}]
    if len(opts) > MAX_GROUPS:
        raise InvalidArgumentError("ShardedAdamW: %d parameter groups (at most %d)"
                                   % (len(opts), MAX_GROUPS), function="python")
    keep = [i for i, (_, p) in enumerate(all_named) if p.requires_grad and p.numel() > 0]
    named = [all_named[i] for i in keep]
    if not named:
        raise InvalidArgumentError("ShardedAdamW: no trainable parameters", function="python")
    if len({id(p) for _, p in named}) != len(named):
        raise InvalidArgumentError("ShardedAdamW: a parameter is listed twice",
                                   function="python")
    return named, [group_of[i] for i in keep], opts


def check_shared_hparams(opts, defaults):
    """betas and eps are the engine's, one value for every group: a group that sets its own
    (to another value than the constructor's) is refused."""
    for g, o in enumerate(opts):
        for k in ("betas", "eps"):
            if k not in o:
                continue
            v = tuple(float(b) for b in o[k]) if k == "betas" else float(o[k])
            if v != defaults[k]:
                raise UnsupportedError("ShardedAdamW: param group %d sets its own %s; betas "
                                       "and eps are the same for every group (pass them to "
                                       "the constructor)" % (g, k), function="python")


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


def check_one_dtype(named):
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
