#!/usr/bin/env bash
# scripts/demo.sh from the test suite, on the build already made: it must exit 0, every
# request must finish although an executor was killed mid-generation, and no process of
# the demo may be left running.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(KVCM_DEMO_SKIP_BOOTSTRAP=1 scripts/demo.sh 2>&1)
status=$?
echo "$out"
fail() { echo "demo_test: $1" >&2; exit 1; }
[[ $status -eq 0 ]] || fail "scripts/demo.sh exited with $status"
grep -q "killed executor pid [0-9]* with SIGKILL while [1-9][0-9]* requests were generating" <<<"$out" ||
  fail "the executor was not killed mid-generation"
grep -q "requests ok: 6; recomputed committed tokens: 0" <<<"$out" || fail "not every request finished"
grep -q "exited: dropped" <<<"$out" || fail "the router did not see the executor die"
grep -q "executor-1 exited (killed by signal 9" <<<"$out" || fail "kvcm-launch did not see it die"
grep -q "restarting executor-1" <<<"$out" || fail "kvcm-launch did not restart it"
grep -q "What is the largest planet? \[openai\]" <<<"$out" || fail "no request went through OpenAI's API"
grep -q "router exited (exit code 0)" <<<"$out" || fail "the router did not stop cleanly"
grep -q "left in the run directory: cache-manager.lock $" <<<"$out" || fail "files left behind"
if pgrep -f "kvcm-demo\." >/dev/null; then fail "a process of the demo still runs"; fi
echo "demo_test: ok"
