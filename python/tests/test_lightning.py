"""Issue 24: Lightning with ShardedAdamW and gradient clipping, against torch.optim.AdamW on
DDP's gradients, at W=2 (torchrun, gloo; lightning_helper.py): automatic optimization with
Trainer(gradient_clip_val=...) and manual optimization with self.clip_gradients(...). Both
clip through torch.nn.utils.clip_grad_norm_ over the optimizer's parameters, whose .grad are
ShardGrads (docs/torch-grads.md): the norm before clipping, read by get_total_norm over p.grad
on each rank, equals DDP's, and the parameters after 4 clipped steps equal torch's.

Tolerance: norms 1e-6 relative, parameters 2e-6 absolute (float32 rounding of the clip
coefficient's path; the run is clipped at every step). Runtime: ~30 s per mode."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from shardgrad import _lib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_lightning_clipping_matches_ddp(tmp_path, mode):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed beside %s" % sys.executable)
    if not _lib.has("sg_comm_create_xport"):
        pytest.skip("libshardgrad without the torch.distributed transport")
    out = str(tmp_path / "lightning.json")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()),
                        os.path.join(HERE, "lightning_helper.py"), out, mode], env=env,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    with open(out) as f:
        res = json.load(f)
    ref_norms, ref_params = res["ref_norms"], res["ref_params"]
    worst = 0.0
    for rank in res["ranks"]:
        assert rank["steps"] == len(ref_norms)
        assert rank["seen"] == pytest.approx(ref_norms, rel=1e-6)
        for a, b in zip(rank["params"], ref_params):
            worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
    print("Lightning %s, W=2: norms %s (DDP %s), max |param - torch| %.2g"
          % (mode, ["%.4f" % v for v in res["ranks"][0]["seen"]],
             ["%.4f" % v for v in ref_norms], worst))
    assert min(ref_norms) > 0.05  # clipping was active at every step
    assert worst <= 2e-6
