#!/usr/bin/env bash
# pip check (scripts/test.sh runs it): the Python package as a new user installs it.
#   1. a fresh venv, `pip install ./python` (scikit-build-core builds libshardgrad with CMake and
#      puts it in the package), then README.md's Python quick start, copied out of the README,
#      run from an empty directory with no SHARDGRAD_LIBRARY and no PYTHONPATH: threads, and
#      `mpirun -np 2 ... --mpi` when the library has MPI; the printed loss must fall;
#   2. `pip wheel .` at the root (pyproject.toml there: the same package): a py3-none-<platform>
#      wheel holding shardgrad/lib/libshardgrad.so, installed into a second fresh venv, where the
#      quick start runs again.
# The quick start needs torch: the venvs see the torch of SG_TORCH_PYTHON (default
# build-venv/bin/python, the venv scripts/test.sh creates) through a .pth file
# appended after their own site-packages, so shardgrad itself still comes from the venv. Without
# that torch the torch steps are reported as SKIP and a NumPy-only engine step runs instead.
# CUDA is off (-C cmake.define.SG_WITH_CUDA=OFF; nvcc would add minutes): SG_PIP_ARGS replaces
# the pip options. The build backend and numpy come at the versions of
# scripts/pydeps/constraints-build.txt (PIP_CONSTRAINT; SG_PIP_NEWEST=1: the newest releases, as
# a new user gets them). Usage: pip_check.sh [WORK_DIR]. Ends with "N passed, M failed, K skipped".
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/shardgrad-pip-check.XXXXXX)}
torch_py=${SG_TORCH_PYTHON:-$ROOT/build-venv/bin/python}
read -r -a pip_args <<<"${SG_PIP_ARGS:--C cmake.define.SG_WITH_CUDA=OFF}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset SHARDGRAD_LIBRARY PYTHONPATH
[ "${SG_PIP_NEWEST:-0}" = 1 ] || export PIP_CONSTRAINT=$ROOT/scripts/pydeps/constraints-build.txt
pass=0 fail=0 skipped=0
rm -rf "$work" && mkdir -p "$work/run"

check() { # check DESCRIPTION COMMAND...: runs it, shows its output on failure
  local what=$1 t0=$SECONDS
  shift
  if "$@" >"$work/last.log" 2>&1; then
    echo "ok   $what ($((SECONDS - t0))s)"
    pass=$((pass + 1))
    return 0
  fi
  echo "FAIL $what: $*"
  sed 's/^/     | /' "$work/last.log" | tail -40
  fail=$((fail + 1))
  return 1
}

skip() {
  echo "SKIP $1"
  skipped=$((skipped + 1))
}

# The README's Python quick start: the first ```python block after "## Python quick start".
awk '/^## Python quick start/{f=1} f&&/^```python/{p=1;next} p&&/^```/{exit} p' \
  "$ROOT/README.md" >"$work/run/train.py"

torch_site=""
if [ -x "$torch_py" ] && "$torch_py" -c "import torch" 2>/dev/null &&
  [ "$("$torch_py" -c 'import sys; print(sys.version_info[:2])')" = \
    "$(python3 -c 'import sys; print(sys.version_info[:2])')" ]; then
  torch_site=$("$torch_py" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
fi

new_venv() { # new_venv DIR: a fresh venv, with the torch venv's packages after its own
  python3 -m venv "$1" || return 1
  if [ -n "$torch_site" ]; then
    "$1/bin/python" -c "import site, sys; open(site.getsitepackages()[0] + '/zz_shardgrad_torch.pth', 'w').write(sys.argv[1] + '\n')" "$torch_site"
  fi
}

# The library the venv's shardgrad loads must be the one inside its own site-packages, and the
# package's version (from include/shardgrad.h at build time) the library's.
lib_in_venv() { # lib_in_venv VENV
  (cd "$work/run" && "$1/bin/python" -c "
import os, sys, shardgrad
from importlib.metadata import version
p = os.path.realpath(shardgrad.library_path())
print(p, shardgrad.__version__, version('shardgrad'), 'mpi' if shardgrad.has_backend('mpi') else 'no mpi')
sys.exit(0 if p.startswith(os.path.realpath(sys.prefix) + os.sep) and
         version('shardgrad') == shardgrad.__version__ else 1)")
}

# The printed losses ("step N loss X") must fall: the last below half the first.
loss_falls() { # loss_falls COMMAND...
  local out
  out=$(cd "$work/run" && "$@" 2>&1) || { echo "$out"; return 1; }
  echo "$out"
  echo "$out" | awk '/^step +[0-9]+ loss /{v[n++]=$4} END{exit !(n >= 2 && v[n-1] < 0.5 * v[0])}'
}

numpy_step() { # a NumPy-only engine step, for when torch is not there
  (cd "$work/run" && "$1/bin/python" -c "
import numpy as np, shardgrad as sg
with sg.Engine(sg.Comm.local(1)[0], lr=0.1) as e:
    pid = e.add_param('w', 8)
    e.finalize()
    e.set_param(pid, np.ones(8, np.float32))
    e.grad(pid)[:] = 1.0
    e.grad_ready(pid)
    e.step()
    w = e.get_param(pid)
    assert (w < 1.0).all(), w
    print('numpy engine step ok:', w[:2])")
}

quickstart() { # quickstart VENV LABEL
  if [ -z "$torch_site" ]; then
    skip "$2: README Python quick start (no torch at $torch_py)"
    check "$2: NumPy-only engine step" numpy_step "$1"
    return
  fi
  check "$2: README Python quick start, 2 threads, loss falls" loss_falls "$1/bin/python" train.py
  if command -v mpirun >/dev/null && (cd "$work/run" && "$1/bin/python" -c \
    "import shardgrad, sys; sys.exit(not shardgrad.has_backend('mpi'))"); then
    check "$2: README Python quick start, mpirun -np 2 --mpi, loss falls" loss_falls \
      mpirun -np 2 --oversubscribe --bind-to none "$1/bin/python" train.py --mpi
  else
    skip "$2: quick start under mpirun (no mpirun, or the library has no MPI)"
  fi
}

# The root's pyproject.toml and python/pyproject.toml describe the same package.
project_table() { sed -n '/^\[project\]/,/^\[tool\./p' "$1" | grep -v '^\[tool\.'; }
check "pyproject.toml and python/pyproject.toml: the same [project] tables" \
  diff <(project_table "$ROOT/pyproject.toml") <(project_table "$ROOT/python/pyproject.toml")

# 1. pip install ./python
if check "fresh venv A" new_venv "$work/venv-a" &&
  check "pip install ./python ${pip_args[*]}" "$work/venv-a/bin/pip" install -q "$ROOT/python" \
    "${pip_args[@]}"; then
  check "venv A: shardgrad loads the library pip built into its site-packages" lib_in_venv \
    "$work/venv-a"
  quickstart "$work/venv-a" "venv A"
fi

# 2. pip wheel . (the root's pyproject.toml), installed into another fresh venv
if check "pip wheel . (the checkout's root) ${pip_args[*]}" "$work/venv-a/bin/pip" wheel -q \
  --no-deps -w "$work/dist" "$ROOT" "${pip_args[@]}"; then
  whl=$(ls "$work"/dist/shardgrad-*.whl 2>/dev/null | head -1)
  check "the wheel is a platform wheel for any Python 3 ($(basename "${whl:-none}"))" \
    bash -c "[[ '$whl' == *-py3-none-linux_*.whl ]]"
  check "the wheel holds shardgrad/lib/libshardgrad.so" python3 -c "
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if 'shardgrad/lib/libshardgrad.so' in names else 'not in: %s' % names)" "$whl"
  check "the wheel holds the shardgrad.torch package (subpackages are not left out)" python3 -c "
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
want = ['shardgrad/torch/__init__.py', 'shardgrad/torch/optim.py', 'shardgrad/torch/comm.py']
sys.exit(0 if all(n in names for n in want) else 'not in: %s' % names)" "$whl"
  if check "fresh venv B" new_venv "$work/venv-b" &&
    check "venv B: pip install the wheel" "$work/venv-b/bin/pip" install -q "$whl"; then
    check "venv B: shardgrad loads the library from the wheel" lib_in_venv "$work/venv-b"
    quickstart "$work/venv-b" "venv B"
  fi
fi

echo "$pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
