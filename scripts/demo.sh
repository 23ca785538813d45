#!/usr/bin/env bash
# The whole stack on this machine, end to end: installs what is missing, builds, gets the
# bundled model (SmolLM2-135M-Instruct, a 94 MB GGUF: scripts/get-model.sh), starts a cache
# manager (shared-memory pool), the router and two executors with kvcm-launch, sends real
# requests over HTTP (TGI's API and OpenAI's chat completions) that share a long system
# prompt, kills one executor mid-generation, shows that every request still finishes (and
# that the launcher starts the executor again), and stops everything.
#
#   scripts/demo.sh
#   KVCM_DEMO_MODEL=path/to/model.gguf scripts/demo.sh   # another model (GGUF or folder)
set -euo pipefail
cd "$(dirname "$0")/.."

# KVCM_DEMO_SKIP_BOOTSTRAP=1: the build is there already (the test suite runs the demo so).
if [[ "${KVCM_DEMO_SKIP_BOOTSTRAP:-0}" != "1" ]]; then scripts/bootstrap.sh; fi
BIN="${KVCM_BUILD_DIR:-build}/bin"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvcm-demo.XXXXXX")"
RUN="$WORK/run"
mkdir -m 0700 "$RUN"
LAUNCH=""

stop_all() {
  [[ -n "$LAUNCH" ]] || return 0
  kill -TERM "$LAUNCH" 2>/dev/null || true
  for _ in $(seq 300); do kill -0 "$LAUNCH" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$LAUNCH" 2>/dev/null || true
  { wait "$LAUNCH"; } 2>/dev/null || true
  LAUNCH=""
}
cleanup() {
  local status=$?
  stop_all
  if [[ $status -ne 0 ]]; then
    echo "demo: failed; the last lines of the launcher's log:" >&2
    [[ -f "$WORK/launch.log" ]] && tail -25 "$WORK/launch.log" >&2
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# await_line FILE REGEX: the first line of FILE matching REGEX, once there is one (at most
# two minutes: the bundled model loads in seconds even on a loaded machine).
await_line() {
  local file=$1 regex=$2
  for _ in $(seq 1200); do
    if grep -Eq "$regex" "$file" 2>/dev/null; then grep -E "$regex" "$file" | head -1; return 0; fi
    sleep 0.1
  done
  echo "demo: timed out waiting for '$regex' in $file" >&2
  return 1
}

echo "== model"
MODEL="${KVCM_DEMO_MODEL:-$(scripts/get-model.sh)}"
echo "   $MODEL"

echo "== kvcm-launch: cache manager (shm pool: 1024 blocks of 16 tokens), router, two executors"
"$BIN/kvcm-launch" --model "$MODEL" --executors 2 --run-dir "$RUN" --backend shm \
  --block-size 16 --num-blocks 1024 --port 0 --threads 1 \
  >"$WORK/launch.log" 2>&1 &
LAUNCH=$!
URL=$(await_line "$WORK/launch.log" "kvcm-launch: ready http=" | sed -E 's/.*ready http=(\S+).*/\1/')
grep -E "kvcm-launch: started" "$WORK/launch.log" | sed -E 's/^\S+ kvcm-launch: /   /'
echo "   $URL"
EXEC1=$(grep -E "kvcm-launch: started executor-1 " "$WORK/launch.log" | sed -E 's/.*pid ([0-9]+).*/\1/')

echo "== blocks before"
"$BIN/kvcmctl" stats --run-dir "$RUN" | head -9

echo "== requests (one streaming), executor-1 killed mid-generation"
python3 scripts/demo_client.py "$URL" --kill-pid "$EXEC1"
# Both saw it die (the router by its pidfd, the launcher by its own) before they are shown.
await_line "$WORK/launch.log" "restarting executor-1" >/dev/null
await_line "$WORK/launch.log" "exited: dropped" >/dev/null
grep -hE "exited: dropped|executor-1 exited|restarting executor-1|started executor-1 " \
  "$WORK/launch.log" | tail -n +2 | sed -E 's/^(\[[a-z0-9-]+\] )?\S+ /   /' || true

echo "== blocks after (the prompts' full blocks stay cached for the next request)"
"$BIN/kvcmctl" stats --run-dir "$RUN" | head -13

echo "== stopping (kvcm-launch stops the router, then the executors, then the cache manager)"
stop_all
grep -hE "kvcm-launch: .*exited|kvcm-launch: stopped" "$WORK/launch.log" | tail -5 |
  sed -E 's/^\S+ kvcm-launch: /   /' 
echo "   all processes stopped; left in the run directory: $(ls -A "$RUN" | tr '\n' ' ')"
echo "   (sockets are removed by their owners; the pool was a memfd: nothing in /dev/shm)"
