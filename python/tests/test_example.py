"""examples/python/train_lm.py runs (2 ranks as threads, a short run; 2 processes under
torchrun, the command in docs/torch.md) and its loss falls."""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("extra", [[], ["--offload"]])
def test_train_lm_example_threads(extra):
    """--offload on the CPU device: accepted, nothing pinned (the state is host memory)."""
    cmd = [sys.executable, os.path.join(REPO, "examples", "python", "train_lm.py"), "--ranks",
           "2", "--steps", "40", "--d", "64", "--layers", "2", "--batch", "4", "--seq", "32",
           "--micro", "2", "--log-every", "10", "--threads", "1"] + extra
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss fell" in r.stdout
    assert "tokens/s" in r.stdout
    assert "rank 0 memory" in r.stdout and "rank 1 memory" in r.stdout
    assert "pinned host memory" not in r.stdout


TRAIN_LM = os.path.join(REPO, "examples", "python", "train_lm.py")


def test_train_lm_example_torchrun():
    """Comm.from_torch over the gloo group torchrun's env:// rendezvous made (~40 s)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed beside %s" % sys.executable)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [torchrun, "--nproc_per_node", "2", "--master_port", str(port), TRAIN_LM]
    # (no --d: torchrun takes it for an abbreviation of one of its own options)
    small = ["--steps", "40", "--layers", "2", "--batch", "4", "--seq", "32",
             "--log-every", "10", "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(base + small, capture_output=True, text=True, timeout=300, env=env)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 ranks (torch)" in r.stdout and "loss fell" in r.stdout
    r = subprocess.run(base + ["--ranks", "2"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode != 0 and "torchrun started this process" in r.stderr, r.stderr


def test_train_lm_example_hybrid():
    """--hybrid 2: 4 ranks as 2 nodes x 2, the loss falls as in the flat run."""
    cmd = [sys.executable, TRAIN_LM, "--ranks", "4", "--hybrid", "2", "--steps", "30", "--d",
           "64", "--layers", "2", "--batch", "4", "--seq", "32", "--micro", "2", "--log-every",
           "10", "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hybrid: 2 nodes x 2 ranks" in r.stdout and "loss fell" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be >= 1 (got 0)"),
    (["--steps"], "argument --steps: expected one argument"),
    (["--heads", "3"], "--heads 3 does not divide --d 128"),
    (["--text", "/nope.txt"], "cannot read --text /nope.txt: No such file or directory"),
    (["--ranks", "0"], "--ranks must be >= 1 (got 0)"),
    (["--seq", "100000"], "--seq 100000 is above 4096"),
    (["--dtype", "fp32"], "invalid choice: 'fp32'"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--plot", "/nonexistent-dir/loss.png"], "--plot /nonexistent-dir/loss.png: no directory"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--offload", "--strategy", "no_shard"], "--offload needs --strategy shard_grad_op or shard_opt"),
    (["--hybrid", "0"], "--hybrid must be >= 1 (got 0)"),
    (["--hybrid", "2", "--ranks", "3"], "--hybrid 2: --ranks 3 is not a multiple of the 2 nodes"),
    (["--hybrid", "2", "--strategy", "no_shard"], "--hybrid shards inside a node"),
])
def test_train_lm_flag_errors(args, message):
    """Each bad flag: one line on stderr naming it, nothing on stdout, a non-zero exit, at once
    (--seq 100000 used to start a run that printed nothing for minutes)."""
    r = subprocess.run([sys.executable, TRAIN_LM] + args, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("train_lm.py: ") and message in lines[0], lines[0]


def test_train_lm_text_too_short(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("tiny text\n")
    r = subprocess.run([sys.executable, TRAIN_LM, "--text", str(short)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().endswith("(%s has 10)" % short) and len(r.stderr.splitlines()) == 1


def test_train_lm_stdlib_corpus_heldout_json(tmp_path):
    """--stdlib-corpus: real text every machine has; --eval-every: the held-out loss (the last
    --heldout of the text, never trained on) on fixed windows; --json: the curves; --opt: a
    ShardedAdamW keyword."""
    out = tmp_path / "lm.json"
    cmd = [sys.executable, TRAIN_LM, "--ranks", "2", "--steps", "6", "--d", "32", "--layers",
           "1", "--heads", "2", "--batch", "2", "--seq", "16", "--threads", "1",
           "--stdlib-corpus", "0.05", "--eval-every", "3", "--eval-batches", "2", "--json",
           str(out), "--opt", "eps=1e-6", "--log-every", "3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "corpus: 50000 characters of the Python" in r.stdout, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert [s for s, _ in res["evals"]] == [3, 6] and len(res["losses"]) == 6
    assert all(math.isfinite(v) and v > 0 for _, v in res["evals"])
    assert res["args"]["opt_kw"] == {"eps": 1e-6}
    bad = subprocess.run([sys.executable, TRAIN_LM, "--opt", "eps"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--opt eps: expected KEY=VALUE" in bad.stderr


def test_train_lm_f16_eta_and_plot(tmp_path):
    """--dtype f16 trains (dynamic loss scaling), log lines carry an eta, --plot writes a PNG."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "loss.png"
    cmd = [sys.executable, TRAIN_LM, "--ranks", "2", "--steps", "30", "--d", "64", "--layers",
           "2", "--batch", "4", "--seq", "32", "--log-every", "10", "--threads", "1",
           "--dtype", "f16", "--plot", str(png)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "f16 params" in r.stdout and "loss fell" in r.stdout
    assert all(" eta " in line for line in r.stdout.splitlines() if line.startswith("step "))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
