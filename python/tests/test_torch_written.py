"""Issue 30 item 1: writes into bf16/f16 parameters after ShardedAdamW is built persist, as
with f32 parameters and with torch.optim.AdamW. Before, the fp32 master was not updated, so the
next step put the weights back near their old values: after fill_(5) and one step at lr 1e-4
the mean was 0.044 (bf16) / -0.098 (f16) instead of ~5; after load_state_dict(pretrained) the
weights went back to their random init.

Each case: W = 1 and 2 (threads), a write through the parameter (load_state_dict, copy_,
fill_, clamp_ under no_grad), one step at lr 1e-4: every parameter within 1e-3 + the
dtype's rounding of the written value. p.data writes (a version counter of their own) need
opt.params_written()."""

import copy

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402

FAST = dict(timeout_ms=60000)


def _model(seed, dtype):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(dtype)


def _write(m, how, pretrained, opt):
    with torch.no_grad():
        if how == "load_state_dict":
            m.load_state_dict(pretrained.state_dict())
        elif how == "copy_":
            for p, q in zip(m.parameters(), pretrained.parameters()):
                p.copy_(q)
        elif how == "fill_":
            for p in m.parameters():
                p.fill_(5.0)
        elif how == "clamp_":
            for p, q in zip(m.parameters(), pretrained.parameters()):
                p.copy_(q * 100)
                p.clamp_(-0.25, 0.25)
        elif how == "data":
            for p, q in zip(m.parameters(), pretrained.parameters()):
                p.data.copy_(q)
            opt.params_written()


def _expected(how, pretrained):
    out = []
    for q in pretrained.parameters():
        if how == "fill_":
            out.append(torch.full_like(q, 5.0))
        elif how == "clamp_":
            out.append((q * 100).clamp(-0.25, 0.25))
        else:
            out.append(q.detach().clone())
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("how", ["load_state_dict", "copy_", "fill_", "clamp_", "data"])
@pytest.mark.parametrize("world", [1, 2])
def test_writes_into_parameters_persist_through_a_step(dtype, how, world):
    base, pretrained = _model(0, dtype), _model(1, dtype)
    want = _expected(how, pretrained)
    kw = dict(loss_scale=1.0) if dtype == torch.float16 else {}

    def body(comm):
        m = copy.deepcopy(base)
        opt = ShardedAdamW(m, comm, lr=1e-4, weight_decay=0.0, **FAST, **kw)
        m(torch.ones(2, 6, dtype=dtype)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        _write(m, how, pretrained, opt)
        m(torch.ones(2, 6, dtype=dtype)).float().square().sum().backward()
        opt.step()
        got = [p.detach().float().clone() for p in m.parameters()]
        masters = [v.clone() for v in opt.master_weights().values()]
        opt.close()
        return got, masters

    for got, masters in sg.run_threads(world, body):
        for g, mw, w in zip(got, masters, want):
            # one AdamW step moves each weight by at most lr (1e-4) plus the working rounding
            tol = 1e-3 + 2 * torch.finfo(dtype).eps * w.float().abs().max().item()
            assert (g - w.float()).abs().max().item() <= tol, how
            assert (mw - w.float()).abs().max().item() <= 2e-4, how


def test_load_refuses_other_shapes_of_the_same_numel(tmp_path):
    """Issue 30 item 5: Linear(6, 4)'s weight [4, 6] saved, loaded into a [6, 4] weight of the
    same name: refused, nothing changed (before: silently reshaped)."""
    comm = sg.Comm.local(1)[0]
    a = torch.nn.Linear(6, 4)
    opt = ShardedAdamW(a, comm, **FAST)
    opt.save(str(tmp_path / "ck"))
    opt.close()
    b = torch.nn.Module()
    torch.manual_seed(5)
    b.weight = torch.nn.Parameter(torch.randn(6, 4))
    b.bias = torch.nn.Parameter(torch.randn(4))
    before = b.weight.detach().clone()
    opt = ShardedAdamW(b, comm, **FAST)
    with pytest.raises(sg.MismatchError, match=r"'weight': \[4, 6\] in the checkpoint, \[6, 4\]"):
        opt.load(str(tmp_path / "ck"))
    assert torch.equal(b.weight.detach(), before)
    opt.close()
    c = torch.nn.Linear(6, 4)  # the same shapes load
    opt = ShardedAdamW(c, comm, **FAST)
    opt.load(str(tmp_path / "ck"))
    assert torch.equal(c.weight.detach(), a.weight.detach())
    opt.close()
    comm.close()
