"""Issue 24: ShardedAdamW's p.grad as third-party code reads it (docs/torch-grads.md).

After backward every parameter's .grad is a ShardGrad standing for the reduced gradient that the
library holds sharded. torch.nn.utils.get_total_norm / clip_grad_norm_ / clip_grads_with_norm_
over the optimizer's parameters give the true global norm on every rank and really clip; any
operation that cannot be answered raises instead of computing a wrong value (before: .grad was
None, and every such reader saw a norm of 0). Also: torch < 2.1 refused at import, and a second
ShardedAdamW over the same parameters refused at construction.

References: torch.optim.AdamW on DDP's gradients (the mean over the ranks' summed gradients),
formed here by summing each rank's loss / W into .grad of one model. Tolerances: norms within
1e-6 relative (the library sums squares in double, torch per parameter in float32), parameters
within 2e-6 (the clip coefficient reaches AdamW through a float32 scale in both)."""

import copy
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
import shardgrad.torch as sgt  # noqa: E402
from shardgrad.torch import GradNorm, ShardedAdamW, ShardGrad  # noqa: E402

FAST = dict(timeout_ms=60000)
W = 2


def _base():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data(steps=2):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(W, 4, 8, generator=g) for _ in range(steps)]


def _reference(base, data, clip=None, mul=None):
    """torch.optim.AdamW on DDP's gradients: per step (norm before clipping, params after)."""
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    norms = []
    for x in data:
        for r in range(W):
            (ref(x[r]).square().sum() / W).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        if mul is not None:
            for p in ref.parameters():
                p.grad.mul_(mul)
        opt.step()
        opt.zero_grad()
    return norms, [p.detach() for p in ref.parameters()]


def _sharded(base, data, reader):
    """Each rank (thread) trains a copy; after every backward reader(model, opt) -> a value;
    returns per rank ([values], [params])."""
    def body(comm):
        m = copy.deepcopy(base)
        opt = ShardedAdamW(m, comm, lr=0.1, **FAST)
        vals = []
        for x in data:
            m(x[comm.rank]).square().sum().backward()
            vals.append(reader(m, opt))
            opt.step()
            opt.zero_grad()
        params = [p.detach().clone() for p in m.parameters()]
        opt.close()
        return vals, params
    return sg.run_threads(W, body)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_get_total_norm_over_p_grad_is_the_global_norm_on_every_rank(foreach):
    """A third-party reader (gradient-norm logging): get_total_norm over every p.grad is the
    norm of the reduced gradient, on each rank, as DDP's .grad gives it."""
    base, data = _base(), _data()
    rnorms, rparams = _reference(base, data)

    def reader(m, opt):
        assert all(isinstance(p.grad, ShardGrad) for p in m.parameters())
        n = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], foreach=foreach)
        assert type(n) is torch.Tensor and n.dtype == torch.float32 and n.dim() == 0
        return n.item()

    out = _sharded(base, data, reader)
    for vals, params in out:
        assert vals == pytest.approx(rnorms, rel=1e-6) and min(vals) > 0
        for a, b in zip(params, rparams):  # reading changed nothing
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


@pytest.mark.parametrize("how", ["clip_grad_norm_", "get_total_norm+clip_grads_with_norm_",
                                 "foreach"])
def test_torch_clipping_through_p_grad_clips_the_library_gradient(how):
    """torch's own clipping (as accelerate 1.16 and Lightning call it) returns the global norm
    and the step applies the clipped gradient: parameters as torch's on DDP's gradients."""
    clip = 0.05
    base, data = _base(), _data(3)
    rnorms, rparams = _reference(base, data, clip=clip)

    def reader(m, opt):
        ps = list(m.parameters())
        if how == "clip_grad_norm_":
            n = torch.nn.utils.clip_grad_norm_(ps, clip)
        elif how == "foreach":
            n = torch.nn.utils.clip_grad_norm_(ps, clip, foreach=True, error_if_nonfinite=True)
        else:
            n = torch.nn.utils.get_total_norm([p.grad for p in ps])
            torch.nn.utils.clip_grads_with_norm_(ps, clip, n)
        after = torch.nn.utils.get_total_norm([p.grad for p in ps]).item()
        return n.item(), after

    out = _sharded(base, data, reader)
    for vals, params in out:
        assert [v[0] for v in vals] == pytest.approx(rnorms, rel=1e-6)
        assert all(v[0] > clip and v[1] == pytest.approx(clip, rel=1e-5) for v in vals)
        for a, b in zip(params, rparams):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def test_in_place_scaling_of_every_grad_reaches_the_step():
    """p.grad.mul_(c) on every parameter, one by one: the step uses c times the gradient."""
    base, data = _base(), _data()
    _, rparams = _reference(base, data, mul=0.25)

    def reader(m, opt):
        for p in m.parameters():
            p.grad.mul_(0.5)
        for p in m.parameters():
            p.grad.div_(torch.tensor(2.0))
        return None

    for _, params in _sharded(base, data, reader):
        for a, b in zip(params, rparams):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)


def _single(**kw):
    comm = sg.Comm.local(1)[0]
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    return m, ShardedAdamW(m, comm, **FAST, **kw), comm


def test_unsupported_operations_raise_instead_of_a_wrong_value():
    m, opt, comm = _single()
    m(torch.ones(2, 4)).sum().backward()
    g = m[0].weight.grad
    assert isinstance(g, ShardGrad) and g.shape == m[0].weight.shape
    assert "ShardGrad" in repr(g)  # printing does not read values
    for op in (lambda: g.sum(), lambda: g.clone(), lambda: g[0], lambda: g.to(torch.float64),
               lambda: g + 1, lambda: g.copy_(torch.zeros(4, 4)), lambda: g.abs().max(),
               lambda: g.mean(), lambda: g.cpu().numpy(), lambda: g.tolist(), lambda: float(g[0, 0]),
               lambda: torch.nn.utils.clip_grad_value_(m.parameters(), 0.1),
               lambda: g.add_(torch.ones(4, 4))):
        with pytest.raises(RuntimeError, match="ShardedAdamW"):
            op()
    # a single parameter's norm (per-layer logging) is not available: loudly
    n = torch.linalg.vector_norm(g)
    assert isinstance(n, GradNorm)
    with pytest.raises(RuntimeError, match="opt.grad_norm"):
        n.item()
    with pytest.raises(RuntimeError, match="only part of"):
        torch.nn.utils.clip_grad_norm_(m[0].parameters(), 1.0)
    with pytest.raises(RuntimeError, match="L2 norm"):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, norm_type=1)
    with pytest.raises(RuntimeError, match="only some parameters"):  # part scaled, then read
        g.mul_(0.5)
        torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    with pytest.raises(RuntimeError, match="only some parameters"):
        opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    with pytest.raises(RuntimeError, match="stale"):
        g.mul_(2.0)
    opt.close()
    comm.close()


def test_norm_with_other_tensors_gradients_and_after_the_step():
    """clip_grad_norm_ over the optimizer's parameters plus plain ones: the norm of both, and
    both clipped; after step() the old p.grad is stale (raises), a new backward shows new ones."""
    m, opt, comm = _single()
    other = torch.nn.Linear(3, 3)
    m(torch.ones(2, 4)).sum().backward()
    other(torch.ones(1, 3)).sum().backward()
    mine = opt.grad_norm()
    theirs = torch.nn.utils.get_total_norm([p.grad for p in other.parameters()]).item()
    n = torch.nn.utils.clip_grad_norm_(list(m.parameters()) + list(other.parameters()), 1e-3)
    assert n.item() == pytest.approx((mine ** 2 + theirs ** 2) ** 0.5, rel=1e-6)
    assert opt.grad_norm() == pytest.approx(mine * 1e-3 / (n.item() + 1e-6), rel=1e-5)
    old = m[0].weight.grad
    opt.step()
    assert opt.last_step_info.grad_norm == pytest.approx(mine * 1e-3 / (n.item() + 1e-6),
                                                         rel=1e-5)
    with pytest.raises(RuntimeError, match="stale"):
        torch.linalg.vector_norm(old)
    m(torch.ones(2, 4)).sum().backward()  # no zero_grad: the new backward replaces them
    assert m[0].weight.grad is not old and isinstance(m[0].weight.grad, ShardGrad)
    assert torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item() > 0
    with pytest.raises(RuntimeError, match="after the step's gradients were scaled"):
        for p in m.parameters():
            p.grad.mul_(0.5)
        m(torch.ones(2, 4)).sum().backward()
    opt.zero_grad()
    opt.close()
    assert all(p.grad is None for p in m.parameters())  # closed: plain torch again
    m(torch.ones(2, 4)).sum().backward()
    assert type(m[0].weight.grad) is torch.Tensor
    comm.close()


def test_zero_on_every_grad_drops_the_gradients():
    """Module.zero_grad(set_to_none=False) zeroes every p.grad in place: the library drops its
    gradients (sg_grad_zero), so the next backward alone makes the step's gradient."""
    m, opt, comm = _single()
    m(torch.full((2, 4), 5.0)).sum().backward()
    m.zero_grad(set_to_none=False)
    m(torch.ones(2, 4)).sum().backward()
    got = opt.grad_norm()
    ref = copy.deepcopy(m)
    for p in ref.parameters():
        p.grad = None
    ref(torch.ones(2, 4)).sum().backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    assert got == pytest.approx(want, rel=1e-6)
    opt.close()
    comm.close()


def test_no_sync_gradients_are_not_readable():
    m, opt, comm = _single()
    with opt.no_sync():
        m(torch.ones(2, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    m(torch.ones(2, 4)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item() > 0
    opt.close()
    comm.close()


def test_clip_grad_norm_replacement_is_opt_in():
    import torch.nn.utils as nnu
    m, opt, comm = _single()
    assert not getattr(nnu.clip_grad_norm_, "_shardgrad", False)
    opt.close()
    comm.close()


def test_patch_clip_grad_norm_routes_an_optimizers_parameters_to_it(monkeypatch):
    """The opt-in: after patch_clip_grad_norm(), torch.nn.utils.clip_grad_norm_ on exactly an
    optimizer's parameters is its clip_grad_norm_ (the coming step clips), on part of them it
    raises, on other tensors it is torch's own."""
    import torch.nn.utils as nnu
    import torch.nn.utils.clip_grad as cg
    for mod in (nnu, cg):  # process-wide: put torch's back after the test
        monkeypatch.setattr(mod, "clip_grad_norm_", mod.clip_grad_norm_)
    sgt.patch_clip_grad_norm()
    sgt.patch_clip_grad_norm()  # idempotent
    assert getattr(nnu.clip_grad_norm_, "_shardgrad", False)
    m, opt, comm = _single()
    calls = []
    real = opt.clip_grad_norm_
    monkeypatch.setattr(opt, "clip_grad_norm_", lambda *a, **k: calls.append(a) or real(*a, **k))
    m(torch.ones(2, 4)).sum().backward()
    n = nnu.clip_grad_norm_(m.parameters(), 1e-3)
    assert calls == [(1e-3,)] and n.item() > 1e-3
    with pytest.raises(RuntimeError, match="only part of"):
        nnu.clip_grad_norm_(m[0].parameters(), 1.0)
    other = torch.nn.Linear(3, 3)
    other(torch.ones(1, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in other.parameters()]))
    assert nnu.clip_grad_norm_(other.parameters(), 1.0).item() == pytest.approx(want.item())
    opt.step()
    assert opt.last_step_info.clip_coef < 1.0
    opt.close()
    comm.close()


def test_second_optimizer_over_the_same_parameters_is_refused():
    """Issue 30 item 6: before, the second one was built and stepped with a norm of 0."""
    m, opt, comm = _single()
    comm2 = sg.Comm.local(1)[0]
    with pytest.raises(sg.InvalidArgumentError, match="already belongs to another ShardedAdamW"):
        ShardedAdamW(m, comm2, **FAST)
    with pytest.raises(sg.InvalidArgumentError, match="'1.bias' already belongs"):
        ShardedAdamW([("1.bias", m[1].bias)], comm2, **FAST)
    m(torch.ones(2, 4)).sum().backward()  # the first still works
    opt.step()
    opt.close()
    opt2 = ShardedAdamW(m, comm2, **FAST)  # once closed, the parameters are free again
    opt2.close()
    comm2.close()
    comm.close()


def test_pickle_and_deepcopy_are_refused():
    """Issue 30 item 7: before, both returned an object that failed at step()."""
    m, opt, comm = _single()
    for f in (lambda: pickle.dumps(opt), lambda: copy.deepcopy(opt), lambda: copy.copy(opt)):
        with pytest.raises(TypeError, match=r"state_dict\(\).*save\(dir\)"):
            f()
    m(torch.ones(2, 4)).sum().backward()
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(m[0].weight.grad)
    opt.step()
    opt.close()
    comm.close()


@pytest.mark.parametrize("version,ok", [("2.0.1", False), ("1.13.1+cu117", False),
                                        ("2.1.0", True), ("2.15.0+cu132", True),
                                        ("2.1.0a0+git1234", True), ("3.0", True)])
def test_torch_version_check(version, ok):
    if ok:
        sgt._require_torch(version)
    else:
        with pytest.raises(ImportError, match=r"torch >= 2.1.*register_post_accumulate_grad_hook"):
            sgt._require_torch(version)


def test_import_on_old_torch_raises_import_error():
    """The module's own import with torch reporting 2.0.1 (no other way to get an old torch)."""
    code = ("import torch; torch.__version__ = '2.0.1'\n"
            "try:\n    import shardgrad.torch\nexcept ImportError as e:\n    print('IE', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("IE shardgrad.torch needs torch >= 2.1"), r.stdout
