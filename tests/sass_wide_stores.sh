#!/usr/bin/env bash
# tests/sass_wide_stores.sh LIBRARY [CUDA_BIN_DIR]
#
# The fused optimizer update kernels (kernels/cuda/sg_cuda_kernels.cu) are bound by memory
# traffic: their fp32 state (m, v, the master weights) must leave each thread as one 128-bit
# store per group of 4, not four 32-bit ones (a plain `*(float4 *)p = v` was compiled to scalar
# STG.E in every instantiation; __stcg gives STG.E.128). This reads the machine code in LIBRARY
# with cuobjdump and fails when an update kernel of any architecture has no STG.E.128.
#
# The update kernels are found by their mangled names (SG_SASS_KERNEL_RE, an extended regular
# expression; the default matches adamw/update/optim kernels and anything taking the segment
# table), so that renaming the kernel keeps the check. cuobjdump: $SG_CUOBJDUMP, PATH,
# CUDA_BIN_DIR, or PyPI's nvidia-cuda-cuobjdump (pip install nvidia-cuda-cuobjdump
# nvidia-cuda-nvdisasm; scripts/test.sh installs it). Without it the check is skipped (exit 77).
set -uo pipefail
lib=${1:?usage: sass_wide_stores.sh LIBRARY [CUDA_BIN_DIR]}
cuda_bin=${2:-}
re=${SG_SASS_KERNEL_RE:-'adamw|update|optim|seg_entry'}

find_cuobjdump() {
  local c d
  for c in "${SG_CUOBJDUMP:-}" "$(command -v cuobjdump 2>/dev/null)" \
    "${cuda_bin:+$cuda_bin/cuobjdump}"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  # PyPI wheels put it in site-packages/nvidia/cu<N>/bin (a namespace package)
  while IFS= read -r d; do
    for c in "$d"/*/bin/cuobjdump; do
      if [ -x "$c" ]; then echo "$c"; return 0; fi
    done
  done < <(python3 -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null)
  return 1
}

if ! cuo=$(find_cuobjdump); then
  echo "SKIP: no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or put the" \
    "CUDA toolkit's bin on PATH); the SASS of the update kernels was not checked"
  exit 77
fi
if [ ! -f "$lib" ]; then
  echo "FAIL: $lib does not exist"
  exit 1
fi
sass=$(mktemp)
trap 'rm -f "$sass"' EXIT
if ! "$cuo" -sass "$lib" >"$sass" 2>&1; then
  echo "FAIL: $cuo -sass $lib:"
  head -20 "$sass"
  exit 1
fi
if ! grep -q 'Function :' "$sass"; then
  echo "SKIP: $lib holds no SASS (a PTX-only CUDA build?); nothing to check"
  exit 77
fi

# One line per (architecture, update kernel): arch, wide stores, 64-bit, 32-bit, name.
report=$(awk -v re="$re" '
  /arch = sm_/ { arch = $3 }
  /Function :/ { fn = $3; if (fn ~ re) { key = arch " " fn; seen[key] = 1; w[key] += 0 } else key = "" }
  key != "" && /STG\.E\.128/ { w[key]++ }
  key != "" && /STG\.E\.64/ { d[key]++ }
  key != "" && /STG\.E[ .]/ && !/STG\.E\.(128|64|U16|U8|S16|S8)/ { s[key]++ }
  END { for (k in seen) { split(k, a, " "); printf "%s %d %d %d %s\n", a[1], w[k], d[k], s[k], a[2] } }
' "$sass" | sort)

if [ -z "$report" ]; then
  echo "FAIL: no kernel in $lib matches /$re/ (the update kernel renamed? set SG_SASS_KERNEL_RE" \
    "or update tests/sass_wide_stores.sh)"
  grep 'Function :' "$sass" | sed 's/^[[:space:]]*/  /' | sort -u | head -20
  exit 1
fi
echo "cuobjdump: $cuo"
echo "arch   STG.E.128 STG.E.64 STG.E(32) kernel"
printf '%s\n' "$report" | awk '{ printf "%-6s %9d %8d %9d %s\n", $1, $2, $3, $4, $5 }'
bad=$(printf '%s\n' "$report" | awk '$2 == 0' | wc -l)
total=$(printf '%s\n' "$report" | wc -l)
if [ "$bad" -gt 0 ]; then
  echo "FAIL: $bad of $total update kernels store their fp32 state without 128-bit stores" \
    "(STG.E.128): see vstore in kernels/cuda/sg_cuda_kernels.cu"
  exit 1
fi
echo "PASS: all $total update kernels have 128-bit stores"
