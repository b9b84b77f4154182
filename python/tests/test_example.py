"""examples/python/train_lm.py runs (2 ranks as threads, a short run) and its loss falls."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_lm_example_threads():
    cmd = [sys.executable, os.path.join(REPO, "examples", "python", "train_lm.py"), "--ranks",
           "2", "--steps", "40", "--d", "64", "--layers", "2", "--batch", "4", "--seq", "32",
           "--micro", "2", "--log-every", "10", "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss fell" in r.stdout
    assert "tokens/s" in r.stdout
    assert "rank 0 memory" in r.stdout and "rank 1 memory" in r.stdout
