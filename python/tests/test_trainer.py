"""Issue 16 item 6: ShardedAdamW as transformers.Trainer's optimizer (optimizers=(opt,
scheduler)), against torch.optim.AdamW under DDP, at W=2 (mpirun, gloo for torch, MPI for
shardgrad through Comm.from_torch()), on a 2-layer GPT-2 built from a config (nothing is
downloaded), 20 steps, Trainer's default max_grad_norm=1.0 (clipping goes through
torch.nn.utils.clip_grad_norm_, which ShardedAdamW answers from the library's gradients).

Tolerance: per-step losses within 1e-5 and Trainer's logged gradient norms within 1e-5
relative (measured: 2.4e-7 and 1.7e-7; the two runs differ only in the order the ranks'
gradients are summed). Runtime: ~40 s (two processes importing transformers)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

import shardgrad as sg  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_trainer_losses_match_torch_adamw_under_ddp(tmp_path):
    if not sg.has_backend("mpi"):
        pytest.skip("libshardgrad built without MPI")
    out = str(tmp_path / "trainer.json")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1",
               MASTER_PORT=str(_free_port()), TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(["mpirun", "-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH", "-x",
                        "SHARDGRAD_LIBRARY", "-x", "OMP_NUM_THREADS", sys.executable,
                        os.path.join(HERE, "trainer_helper.py"), out, str(STEPS)],
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    with open(out) as f:
        res = json.load(f)
    t, s = res["torch"], res["sharded"]
    assert t["wrapped"] == "DistributedDataParallel"  # the reference is DDP
    assert s["wrapped"] == "GPT2LMHeadModel"  # not wrapped: the optimizer reduces
    assert len(t["loss"]) == len(s["loss"]) == STEPS
    dl = max(abs(a - b) for a, b in zip(t["loss"], s["loss"]))
    dn = max(abs(a - b) / a for a, b in zip(t["grad_norm"], s["grad_norm"]))
    print("Trainer, %d steps at W=2: loss %.4f -> %.4f (DDP + AdamW) / %.4f (ShardedAdamW); "
          "max loss difference %.2g, max grad-norm relative difference %.2g"
          % (STEPS, t["loss"][0], t["loss"][-1], s["loss"][-1], dl, dn))
    assert dl <= 1e-5 and dn <= 1e-5
    assert s["loss"][-1] < s["loss"][0] - 1.0  # it learns
    assert max(s["grad_norm"]) > 1.0  # clipping at 1.0 was active in some step
