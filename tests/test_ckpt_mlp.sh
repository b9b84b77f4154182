#!/usr/bin/env bash
# The MLP example's --save DIR --save-every N --resume DIR: 20 steps straight against 10 steps
# with saves, then a resume (another strategy and bucket size) to step 20: the losses of steps
# 10..19 are identical, digit for digit; resuming at W=3 and W=1 works too.
#   test_ckpt_mlp.sh PATH_TO_MLP_BINARY
set -u
MLP=$1
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
pass=0
fail=0
check() { # check DESCRIPTION COMMAND...
  local what=$1
  shift
  if "$@"; then pass=$((pass + 1)); echo "ok: $what"; else fail=$((fail + 1)); echo "FAIL: $what"; fi
}
losses() { grep '^step' "$1" | awk '{print $2, $4}'; }

A="--hidden 32 --layers 3 --batch 16 --bucket-mb 0.004 --log-every 1 --dtype bf16 --lr 0.01"
"$MLP" --ranks 2 --steps 20 $A > "$D/straight.log" 2>&1
check "20 steps straight at W=2" test $? -eq 0
"$MLP" --ranks 2 --steps 10 --save "$D/ck" --save-every 4 $A > "$D/first.log" 2>&1
check "10 steps at W=2 with --save-every 4" test $? -eq 0
check "saves at steps 4, 8 and the last (10)" test "$(grep -c '^saved step' "$D/first.log")" -eq 3
"$MLP" --ranks 2 --steps 20 --resume "$D/ck" --strategy shard_opt --bucket-mb 0.01 $A \
  > "$D/resumed.log" 2>&1
check "--resume at W=2 SHARD_OPT" test $? -eq 0
check "resumed at step 10" grep -q 'resumed from .* at step 10' "$D/resumed.log"
losses "$D/straight.log" | tail -n 10 > "$D/a.txt"
losses "$D/resumed.log" > "$D/b.txt"
check "losses of steps 10..19 equal those of the straight run" cmp -s "$D/a.txt" "$D/b.txt"
check "10 losses compared" test "$(wc -l < "$D/b.txt")" -eq 10
for w in 3 1; do
  "$MLP" --ranks $w --steps 14 --resume "$D/ck" --strategy no_shard $A > "$D/w$w.log" 2>&1
  check "--resume at W=$w NO_SHARD trains steps 10..13" test "$(losses "$D/w$w.log" | wc -l)" -eq 4
done
"$MLP" --ranks 2 --steps 12 --resume "$D/missing" $A > "$D/missing.log" 2>&1
check "--resume from a missing directory fails with SG_ERR_IO" grep -q SG_ERR_IO "$D/missing.log"
echo "$pass passed, $fail failed"
test "$fail" -eq 0
