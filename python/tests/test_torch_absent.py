"""Issue 30 item 3.3: parameters without a gradient in a step are skipped, as torch.optim.AdamW
skips a parameter whose .grad is None: frozen with requires_grad_(False) after construction,
unused in a forward pass, and a step() with no backward at all (which must not advance any step
count either). ShardedAdamW against torch.optim.AdamW (single-tensor, foreach=False) on a model
whose gradients are given exactly (the loss is linear in the parameters): the skipped
parameters must stay bit for bit, every parameter's own step count (param_state's 'step') must
be torch's state['step'], and the others must follow torch (moments and values within a few
float32 ulps: torch's CPU kernels may fuse or misround, see test_torch_exact.py). Before the
fix a frozen parameter decayed and moved with its momentum at every step."""

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


class Net(torch.nn.Module):
    """loss = sum(a * x) + sum(b * y) + [sum(c * z)]: the gradients are the inputs exactly."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(300))
        self.b = torch.nn.Parameter(torch.randn(70))
        self.c = torch.nn.Parameter(torch.randn(130))

    def forward(self, x, y, z, use_c):
        loss = (self.a * x).sum() + (self.b * y).sum()
        return loss + (self.c * z).sum() if use_c else loss


# step: (b frozen, c used, backward at all)
SCHEDULE = [(False, True, True), (True, True, True), (True, False, True), (True, True, False),
            (False, False, True), (False, True, True)]


def test_parameters_without_gradient_are_skipped_like_torch_adamw():
    torch.manual_seed(0)
    base = Net()
    ref, mine = Net(), Net()
    ref.load_state_dict(base.state_dict())
    mine.load_state_dict(base.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    comm = sg.Comm.local(1)[0]
    opt = ShardedAdamW(mine, comm, **HP)
    g = torch.Generator().manual_seed(1)
    try:
        for k, (frozen, use_c, backward) in enumerate(SCHEDULE):
            x, y, z = (torch.randn(n, generator=g) for n in (300, 70, 130))
            for model, o in ((ref, ropt), (mine, opt)):
                model.b.requires_grad_(not frozen)
                if backward:
                    model(x, y, z, use_c).backward()
                o.step()
                o.zero_grad()
            for name in ("a", "b", "c"):
                rp, mp = getattr(ref, name), getattr(mine, name)
                st = ropt.state.get(rp, {})
                ps = opt.param_state(mp)
                want = int(st["step"]) if st else 0
                assert int(ps["step"]) == want, (k, name, int(ps["step"]), want)
                if not st:  # never updated: still the initial value, moments zero
                    assert torch.equal(mp.detach(), getattr(base, name).detach()), (k, name)
                    assert not ps["exp_avg"].any() and not ps["exp_avg_sq"].any(), (k, name)
                    continue
                torch.testing.assert_close(ps["exp_avg"], st["exp_avg"], rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(ps["exp_avg_sq"], st["exp_avg_sq"], rtol=1e-5,
                                           atol=1e-9)
                torch.testing.assert_close(mp.detach(), rp.detach(), rtol=1e-5, atol=1e-6)
        # b was frozen in steps 2-4, c unused in 3 and 5, and step 4 had no backward: b's
        # count is 3 of the 5 steps with a backward (torch's too, checked above).
        assert int(opt.param_state(mine.b)["step"]) == 3
        assert opt.step_count == 5  # the step without any gradient does not count
    finally:
        opt.close()
        comm.close()


def test_frozen_parameter_stays_bit_for_bit():
    """The reproducer: frozen after construction, a parameter must not move at all."""
    torch.manual_seed(2)
    m = Net()
    comm = sg.Comm.local(1)[0]
    opt = ShardedAdamW(m, comm, **HP)
    try:
        x, y, z = torch.randn(300), torch.randn(70), torch.randn(130)
        m(x, y, z, True).backward()
        opt.step()
        opt.zero_grad()
        m.b.requires_grad_(False)
        b0, c0 = m.b.detach().clone(), m.c.detach().clone()
        st0 = opt.param_state(m.b)
        for _ in range(3):
            m(x, y, z, False).backward()  # b frozen, c unused
            opt.step()
            opt.zero_grad()
        opt.step()  # no backward at all
        assert torch.equal(m.b.detach(), b0) and torch.equal(m.c.detach(), c0)
        st = opt.param_state(m.b)
        assert torch.equal(st["exp_avg"], st0["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], st0["exp_avg_sq"])
        assert int(st["step"]) == 1 and int(opt.param_state(m.a)["step"]) == 4
    finally:
        opt.close()
        comm.close()
