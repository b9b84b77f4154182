#!/usr/bin/env bash
# The dependency rules of DESIGN.md section 1, checked over the #include lines of the library
# (include/, src/, kernels/). Run by ctest (test_deps); by hand: scripts/check_deps.sh [root].
#
# 1. Folders: a quoted include may only reach the folders its own folder depends on (the table
#    below). Each include is resolved relative to the including file, as the compiler does;
#    "shardgrad.h" (the include path) is include/shardgrad.h.
# 2. System headers of the backends: CUDA and NCCL headers only in the files that own them,
#    mpi.h only in the MPI communicator.
# 3. The public header includes nothing but <stddef.h> and <stdint.h>.
# 4. Strategy seam: no code outside src/engine/strategy/ branches on the strategy.
# 5. Optimizer seam: in src/ only an optimizer's own file (src/optim/sg_<name>.c) and the table
#    registering it (src/optim/sg_optimizer.c) name it (AdamW: adamw, exp_avg, m_off/v_off);
#    everything else knows it by its descriptor (its kernels live in kernels/).
# 6. Engine files: no call circle among them; the base services and the accumulator's helpers
#    call no other engine file, nothing in src/engine calls the lifecycle file.
# 7. Policy seam: outside src/engine/policy/ and src/engine/strategy/ no test of which policy
#    variant an engine holds (a NULL op, `strat->state`, hybrid(e), a device kind in the engine);
#    the count of such tests is printed (0).
# 8. Settings: getenv only in src/core/sg_env.c (the one table of SG_* variables).
# Prints one line per violation and exits 1 if there is any.
# --selftest: the rules must catch a planted violation of each kind in a copy of the tree.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = --selftest ]; then
  tmp=$(mktemp -d) || exit 2
  trap 'rm -rf "$tmp"' EXIT
  (cd "$here" && find include src kernels -type f | tar cf - -T -) | tar xf - -C "$tmp"
  echo '#include "../engine/sg_engine_internal.h"' >> "$tmp/src/plan/sg_plan.c"
  echo '#include <mpi.h>' >> "$tmp/src/engine/sg_step.c"
  echo '#include <stdio.h>' >> "$tmp/include/shardgrad.h"
  echo 'static int planted(const sg_engine *e) { return e->cfg.strategy == SG_NO_SHARD; }' >> "$tmp/src/engine/sg_grads.c"
  echo '/* planted: sg__cpu_adamw */' >> "$tmp/src/device/cpu.c"
  echo 'sg_status planted_up(sg_engine *e) { return sg__grads_flush(e, "planted"); }' >> "$tmp/src/engine/sg_engine_base.c"
  echo 'static const char *planted_env(void) { return getenv("SG_PLANTED"); }' >> "$tmp/src/comm/comm.c"
  echo 'static int planted_kind(const sg_engine *e) { return e->strat->shard->gather != NULL; }' >> "$tmp/src/engine/sg_step.c"
  out=$("$0" "$tmp")
  rc=$?
  n=$(echo "$out" | grep -c '^check_deps: .*\(may not depend\|allowed only in\|public header\|branches on the strategy\|names an optimizer\|in a circle\|the base services call none\|which policy variant\|reads the environment\)')
  echo "$out"
  if [ $rc = 1 ] && [ "$n" = 9 ]; then echo "check_deps selftest: the 9 planted violations found"; exit 0; fi
  echo "check_deps selftest: expected exit 1 and 9 violations, got exit $rc and $n"
  exit 1
fi
root=${1:-$here}
cd "$root" || exit 2

# folder -> folders it may include from (itself always allowed)
declare -A ALLOW=(
  [include]=""
  [src/core]="include"
  [src/plan]="include src/core"
  [kernels]="include"
  [kernels/cpu]="include kernels kernels/cuda" # sumsq's chunk size, shared with the GPU partition
  [kernels/cuda]="include kernels"
  [src/optim]="include src/core kernels kernels/cpu kernels/cuda" # descriptors over the kernels
  [src/device]="include src/core src/optim kernels kernels/cpu kernels/cuda"
  [src/comm]="include src/core src/device kernels kernels/cpu" # the interface, split, lifecycle
  [src/comm/coll]="include src/core src/device src/comm kernels kernels/cpu" # point-to-point algorithms
  [src/comm/backend]="include src/core src/device src/comm src/comm/coll kernels kernels/cpu"
  [src/offload]="include src/core src/device src/optim kernels kernels/cpu"
  [src/memory]="include src/core src/plan src/device src/comm kernels"
  [src/engine]="include src/core src/plan src/memory src/device src/comm src/offload src/optim src/engine/policy kernels kernels/cpu"
  [src/engine/policy]="include src/core src/plan src/memory src/device src/comm src/offload src/optim src/engine kernels kernels/cpu"
  [src/engine/strategy]="include src/core src/plan src/memory src/device src/comm src/offload src/optim src/engine src/engine/policy kernels kernels/cpu"
  [src/estimate]="include src/core src/plan src/memory src/engine src/engine/policy src/optim kernels" # the step-time model reads the strategy table
  [src/ckpt]="include src/core src/plan src/memory src/device src/comm src/engine src/optim kernels kernels/cpu"
)
# single files allowed a header of a folder their folder may not reach: "file header" (why)
EXCEPTIONS=(
  # the NCCL communicator picks its GPU at creation and tells device from host buffers as the
  # CUDA device does (its stream and waits come through the device vtable's comm_attach)
  "src/comm/backend/nccl.c src/device/sg_device_cuda.h"
  "src/comm/backend/sg_nccl_boot.c src/device/sg_device_cuda.h" # how many GPUs (MPI bootstrap)
)
# system headers -> the only files (regex over the path) that may include them
declare -A SYSTEM=(
  # the CUDA device: cuda.c and its internal header (shared with sg_cuda_queue.c and
  # sg_cuda_segtab.c, the device's queue/waits and segment tables, and sg_cuda_replica.c)
  [cuda_runtime.h]='^(src/device/cuda\.c|src/device/sg_cuda_internal\.h|src/comm/backend/nccl\.c|kernels/cuda/.*)$'
  [cuda.h]='^(src/device/cuda\.c|src/device/sg_cuda_internal\.h|kernels/cuda/.*)$'
  [cuda_bf16.h]='^(src/device/cuda\.c|src/device/sg_cuda_internal\.h|kernels/cuda/.*)$'
  [cuda_fp16.h]='^(src/device/cuda\.c|kernels/cuda/.*)$'
  [nccl.h]='^(src/comm/backend/nccl\.c|src/comm/backend/sg_nccl_dl\.h)$'
  [mpi.h]='^(src/comm/backend/mpi\.c|src/comm/backend/sg_nccl_boot\.c)$' # boot: the MPI bootstrap of the NCCL id
)
# folder-internal headers that other folders must not reach even where the folder is allowed
declare -A PRIVATE=(
  [src/device/sg_device_cuda.h]='^(src/device/.*)$'
  [src/device/sg_cuda_internal.h]='^src/device/(cuda\.c|sg_cuda_queue\.c|sg_cuda_segtab\.c|sg_cuda_replica\.c)$'
)

fail=0
violation() { echo "check_deps: $1"; fail=1; }

# normalise a/b/../c -> a/c
norm() {
  local IFS=/ out=() p
  for p in $1; do
    case $p in
      ''|.) ;;
      ..) [ ${#out[@]} -gt 0 ] && unset 'out[${#out[@]}-1]' ;;
      *) out+=("$p") ;;
    esac
  done
  echo "${out[*]}"
}

folder_of() { # the table's key for a file: the longest listed prefix
  local d
  d=$(dirname "$1")
  while [ "$d" != "." ] && [ -z "${ALLOW[$d]+x}" ]; do d=$(dirname "$d"); done
  echo "$d"
}

is_exception() {
  local x
  for x in "${EXCEPTIONS[@]}"; do [ "$x" = "$1 $2" ] && return 0; done
  return 1
}

files=$(find include src kernels -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \
          -o -name '*.cpp' -o -name '*.cuh' \) | sort)
for f in $files; do
  from=$(folder_of "$f")
  if [ -z "${ALLOW[$from]+x}" ]; then
    violation "$f: its folder is not in the dependency table (scripts/check_deps.sh)"
    continue
  fi
  while IFS= read -r line; do
    if [[ $line =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\"([^\"]+)\" ]]; then
      inc=${BASH_REMATCH[1]}
      if [ "$inc" = "shardgrad.h" ]; then target=include/shardgrad.h
      else target=$(norm "$(dirname "$f")/$inc"); fi
      if [ ! -f "$target" ]; then
        violation "$f: includes \"$inc\", which is not a file of the tree ($target)"
        continue
      fi
      to=$(folder_of "$target")
      if [ -n "${PRIVATE[$target]+x}" ] && ! [[ $f =~ ${PRIVATE[$target]} ]] &&
         ! is_exception "$f" "$target"; then
        violation "$f: includes $target, private to its folder"
        continue
      fi
      [ "$to" = "$from" ] && continue
      ok=0
      for a in ${ALLOW[$from]}; do [ "$a" = "$to" ] && ok=1; done
      [ $ok = 1 ] || is_exception "$f" "$target" ||
        violation "$f: includes $target, but $from may not depend on $to (DESIGN.md section 1)"
    elif [[ $line =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\<([^\>]+)\> ]]; then
      inc=${BASH_REMATCH[1]}
      if [ "$f" = include/shardgrad.h ] && [ "$inc" != stddef.h ] && [ "$inc" != stdint.h ]; then
        violation "$f: the public header includes <$inc> (only <stddef.h> and <stdint.h>)"
      fi
      if [ -n "${SYSTEM[$inc]+x}" ] && ! [[ $f =~ ${SYSTEM[$inc]} ]]; then
        violation "$f: includes <$inc>, allowed only in ${SYSTEM[$inc]}"
      fi
    fi
  done < "$f"
done
# 4. Seams (DESIGN.md section 1): no code outside the strategy files compares or switches on the
#    strategy (the engine calls through e->strat); sg_config.c only validates the value.
strategy_files='^(src/engine/strategy/.*|src/core/sg_config\.c)$'
for f in $files; do
  [[ $f =~ $strategy_files ]] && continue
  grep -nE 'strategy[[:space:]]*(==|!=|<=|>=|<|>)|[!=]=[[:space:]]*SG_(NO_SHARD|SHARD_OPT|SHARD_GRAD_OP)\b|case[[:space:]]+SG_(NO_SHARD|SHARD_OPT|SHARD_GRAD_OP)\b|switch[[:space:]]*\([^)]*strategy' "$f" |
    while IFS= read -r hit; do echo "check_deps: $f:$hit: branches on the strategy outside src/engine/strategy/"; done |
    grep . && fail=1
done
# 5. Optimizer seam: the names of an optimizer only in its descriptor's file (src/optim/) and
#    its kernels (kernels/, outside src/).
optim_files='^src/optim/(sg_adamw\.c|sg_optimizer\.c)$' # its file, and the table registering it
for f in $files; do
  [[ $f =~ ^src/ ]] || continue
  [[ $f =~ $optim_files ]] && continue
  grep -niE 'adamw|exp_avg|\<[mv]_off\>' "$f" |
    while IFS= read -r hit; do echo "check_deps: $f:$hit: names an optimizer outside its file (src/optim/)"; done |
    grep . && fail=1
done
# 6. Engine files call each other without a circle (DESIGN.md section 1): the base services
#    (sg_engine_base.c) and the accumulator's helpers (sg_accum.c) call no engine file, the
#    lifecycle (sg_engine.c) is called by none, and the policy tables and the files between
#    them only downwards. An edge is a use, outside comments, of an sg__ name another engine
#    file defines (a function or a table); tsort finds a circle.
engine_files=$(echo "$files" | grep -E '^src/engine/.*\.c$')
strip_comments() { perl -0pe 's{/\*.*?\*/}{ }gs; s{//[^\n]*}{}g' "$1"; }
defs=$(for f in $engine_files; do
  strip_comments "$f" | grep -oE '^[A-Za-z][^;(]*[ *]sg__[A-Za-z0-9_]+[[:space:]]*(\(|=|\[)' |
    grep -vE '^(static|typedef|extern)\b' | grep -oE 'sg__[A-Za-z0-9_]+[[:space:]]*[(=[]$' | tr -d '(=[ ' |
    while read -r s; do echo "$s $f"; done
done)
edges=$(for f in $engine_files; do
  strip_comments "$f" | grep -oE '\bsg__[A-Za-z0-9_]+\b' | sort -u |
    awk -v f="$f" 'NR == FNR { def[$1] = $2; next } ($1 in def) && def[$1] != f { print f, def[$1] }' \
      <(echo "$defs") - | sort -u
done)
if [ -n "$edges" ] && ! loop=$(echo "$edges" | tsort 2>&1 >/dev/null); then :; fi
if echo "${loop:-}" | grep -q 'loop'; then
  violation "the engine files call each other in a circle: $(echo "$loop" | grep -v 'input contains a loop' | sed 's/^tsort: //' | tr '\n' ' ')"
fi
for f in src/engine/sg_engine_base.c src/engine/sg_accum.c; do
  echo "$edges" | grep -q "^$f " &&
    violation "$f calls another engine file ($(echo "$edges" | grep "^$f " | cut -d' ' -f2 | tr '\n' ' ')): the base services call none"
done
echo "$edges" | grep -q ' src/engine/sg_engine\.c$' &&
  violation "the lifecycle file is called by $(echo "$edges" | grep ' src/engine/sg_engine\.c$' | cut -d' ' -f1 | tr '\n' ' ')(only src/ckpt may)"
# 7. Policy seam (DESIGN.md section 10): the policy tables are never NULL and say what a caller
#    must know as declared properties, so outside the policy and strategy files nothing tests
#    which variant it holds: no `strat->state` (the old nullable state table), no hybrid(e) or
#    staged(e), no policy op tested for NULL or as a boolean, no device or communicator kind
#    tested in src/engine. Prints the count of such tests (0).
policy_files='^src/engine/(policy|strategy)/'
policy_ref='e->(strat(->(slots|shard|place))?|rep\.ops)->[a-z_]+'
declared='->(sharded|host|coded|skips|share_scratch|name|reduce_label)\b'
kind_tests=0
for f in $files; do
  [[ $f =~ ^src/ ]] || continue
  [[ $f =~ $policy_files ]] && continue
  hits=$(strip_comments "$f" | grep -nE "strat->state\b|\<(hybrid|staged)\(e\)|(!|\(|&&|\|\||\?)[[:space:]]*$policy_ref[[:space:]]*(\)|&&|\|\||\?|[!=]=[[:space:]]*NULL)|$policy_ref[[:space:]]*[!=]=[[:space:]]*NULL" |
         grep -vE -e "$declared[[:space:]]*(\)|&&|\|\||\?)" )
  if [[ $f =~ ^src/engine/ ]]; then
    hits+=$'\n'$(strip_comments "$f" | grep -nE '(dev|device)->kind[[:space:]]*[!=]=|->stream_ordered\b')
  fi
  while IFS= read -r hit; do
    [ -n "$hit" ] || continue
    echo "check_deps: $f:$hit: tests which policy variant it holds outside src/engine/policy/"
    kind_tests=$((kind_tests + 1))
    fail=1
  done <<< "$hits"
done
echo "check_deps: $kind_tests policy-kind tests outside the policy files"
# 8. Settings: the environment is read in one file, the table of every SG_* variable
#    (src/core/sg_env.c, docs/environment.md generated from it).
for f in $files; do
  [[ $f =~ ^src/ ]] || continue
  [ "$f" = src/core/sg_env.c ] && continue
  strip_comments "$f" | grep -nE '\<(secure_)?getenv[[:space:]]*\(' |
    while IFS= read -r hit; do echo "check_deps: $f:$hit: reads the environment outside src/core/sg_env.c"; done |
    grep . && fail=1
done
[ $fail = 0 ] && echo "check_deps: $(echo "$files" | wc -l) files follow the dependency rules"
exit $fail
