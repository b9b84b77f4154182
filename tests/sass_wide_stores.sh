#!/usr/bin/env bash
# tests/sass_wide_stores.sh LIBRARY [CUDA_BIN_DIR]
#
# The fused AdamW update kernels (kernels/cuda/sg_cuda_kernels.cu, adamw_kernel<P, G>: P the
# parameter dtype, G the gradient dtype, 0 f32, 1 bf16, 2 f16) are bound by memory traffic:
# every full group of 4 must move its fp32 arrays as one 128-bit access per array, not four
# 32-bit ones (a plain `*(float4 *)p = v` was compiled to scalar STG.E in every instantiation;
# __stcg gives STG.E.128). This reads the machine code in LIBRARY with cuobjdump and fails
# unless, for every variant and architecture:
#   LDG.E.128 >= 3 + (G == 0)   master or f32 parameter, m, v (+ an f32 gradient)
#   STG.E.128 >= 3              the same three written back
#   STG.E.64  >= 1 when P != 0  the 16-bit parameter's group of 4
# (16-bit gradients are LDG.E.64, which the segment table's loads also are: not counted.)
# Run after each build where cuobjdump is found (tests/cuda_sass.cmake), else by ctest.
#
# The kernels are found by their mangled names (SG_SASS_KERNEL_RE, an extended regular
# expression, default adamw_kernel; the template arguments are read from ILi<P>ELi<G>E), so that
# a variant added later is checked too. cuobjdump: $SG_CUOBJDUMP, PATH, CUDA_BIN_DIR, or PyPI's
# nvidia-cuda-cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm; scripts/test.sh
# installs it). Without it the check is skipped (exit 77).
set -uo pipefail
lib=${1:?usage: sass_wide_stores.sh LIBRARY [CUDA_BIN_DIR]}
cuda_bin=${2:-}
re=${SG_SASS_KERNEL_RE:-'adamw_kernel'}

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

# One line per (architecture, update kernel): arch, LDG.E.128, STG.E.128, STG.E.64, STG.E (32),
# P, G, name.
report=$(awk -v re="$re" '
  /arch = sm_/ { arch = $3 }
  /Function :/ { fn = $3; if (fn ~ re) { key = arch " " fn; seen[key] = 1 } else key = "" }
  key != "" && /LDG\.E\.128/ { l[key]++ }
  key != "" && /STG\.E\.128/ { w[key]++ }
  key != "" && /STG\.E\.64/ { d[key]++ }
  key != "" && /STG\.E[ .]/ && !/STG\.E\.(128|64|U16|U8|S16|S8)/ { s[key]++ }
  END {
    for (k in seen) {
      split(k, a, " ")
      p = g = "?"
      if (match(a[2], /ILi[0-9]ELi[0-9]E/)) {
        p = substr(a[2], RSTART + 3, 1)
        g = substr(a[2], RSTART + 7, 1)
      }
      printf "%s %d %d %d %d %s %s %s\n", a[1], l[k], w[k], d[k], s[k], p, g, a[2]
    }
  }
' "$sass" | sort)

if [ -z "$report" ]; then
  echo "FAIL: no kernel in $lib matches /$re/ (the update kernel renamed? set SG_SASS_KERNEL_RE" \
    "or update tests/sass_wide_stores.sh)"
  grep 'Function :' "$sass" | sed 's/^[[:space:]]*/  /' | sort -u | head -20
  exit 1
fi
# The verdict per line (see the top of the file); a name without ILi<P>ELi<G>E fails.
table=$(printf '%s\n' "$report" | awk '{
  ok = $6 != "?" && $2 >= 3 + ($7 == "0") && $3 >= 3 && ($6 == "0" || $4 >= 1)
  printf "%-6s %s %s %9d %9d %8d %9d %-6s %s\n", $1, $6, $7, $2, $3, $4, $5, ok ? "ok" : "NARROW", $8
}')
echo "cuobjdump: $cuo"
echo "arch   P G LDG.E.128 STG.E.128 STG.E.64 STG.E(32) verdict kernel"
printf '%s\n' "$table"
total=$(printf '%s\n' "$table" | wc -l)
bad=$(printf '%s\n' "$table" | awk '$8 != "ok"' | wc -l)
if [ "$bad" -gt 0 ]; then
  echo "FAIL: $bad of $total AdamW kernels lack 128-bit loads or stores on a full-vector path" \
    "(see vload/vstore in kernels/cuda/sg_cuda_kernels.cu)"
  exit 1
fi
echo "PASS: all $total AdamW kernels use 128-bit loads and stores on their full-vector paths"
