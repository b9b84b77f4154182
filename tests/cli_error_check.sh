#!/usr/bin/env bash
# cli_error_check.sh PATTERN COMMAND...: a command-line error as a user sees it. Passes when the
# command exits non-zero, prints nothing on stdout and exactly one line on stderr, and that line
# matches the extended regular expression PATTERN.
set -u
pattern=$1
shift
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
"$@" >"$out" 2>"$err"
rc=$?
echo "exit $rc; stderr:"
cat "$err"
ok=1
[ "$rc" -ne 0 ] || { echo "FAIL: exit status 0"; ok=0; }
[ ! -s "$out" ] || { echo "FAIL: stdout is not empty:"; head -5 "$out"; ok=0; }
[ "$(wc -l <"$err")" -eq 1 ] || { echo "FAIL: stderr is not one line"; ok=0; }
grep -Eq -- "$pattern" "$err" || { echo "FAIL: stderr does not match: $pattern"; ok=0; }
[ "$ok" -eq 1 ] && echo "ok"
[ "$ok" -eq 1 ]
