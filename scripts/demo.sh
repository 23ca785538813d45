#!/usr/bin/env bash
# The whole stack on this machine, end to end: installs what is missing, builds, makes the
# model, starts a cache manager (shared-memory pool), the router and two executors, sends
# real requests over HTTP (TGI's API) that share a long system prompt, kills one executor
# mid-generation, shows that every request still finishes, and stops everything.
#
#   scripts/demo.sh
#
# The model is the tiny random Llama (tools/make_tiny_model) until a real one is bundled:
# its words are noise, but every byte goes through the real path (tokenizer, scheduler,
# cache manager, pool, executors). A tiny model computes a step in microseconds, so the
# executors are slowed to 2 ms per layer (--fault-layer-delay-ms) to let the kill land while
# the requests generate.
set -euo pipefail
cd "$(dirname "$0")/.."

# KVCM_DEMO_SKIP_BOOTSTRAP=1: the build is there already (the test suite runs the demo so).
if [[ "${KVCM_DEMO_SKIP_BOOTSTRAP:-0}" != "1" ]]; then scripts/bootstrap.sh; fi
BIN="${KVCM_BUILD_DIR:-build}/bin"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvcm-demo.XXXXXX")"
RUN="$WORK/run"
mkdir -m 0700 "$RUN"
PIDS=()

stop_all() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    { wait "$pid"; } 2>/dev/null || true
  done
  PIDS=()
}
cleanup() {
  local status=$?
  stop_all
  if [[ $status -ne 0 ]]; then
    echo "demo: failed; the last lines of each log:" >&2
    for log in "$WORK"/*.log; do [[ -f "$log" ]] && { echo "== $log" >&2; tail -5 "$log" >&2; }; done
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# Waits until FILE has a line matching REGEX; prints the line.
await_line() {
  local file=$1 regex=$2
  for _ in $(seq 300); do
    if grep -Eq "$regex" "$file" 2>/dev/null; then grep -E "$regex" "$file" | head -1; return 0; fi
    sleep 0.1
  done
  echo "demo: timed out waiting for '$regex' in $file" >&2
  return 1
}

echo "== model"
"$BIN/kvcm-make-tiny-model" --output "$WORK/model" --seed 1

echo "== cache manager (shm pool: 1024 blocks of 16 tokens)"
"$BIN/kvcm-cache-manager" --run-dir "$RUN" --backend shm --block-size 16 --num-blocks 1024 \
  --model-config "$WORK/model/config.json" --metrics-address 127.0.0.1:0 >"$WORK/cache-manager.log" 2>&1 &
PIDS+=($!)
await_line "$WORK/cache-manager.log" "ready epoch=" >/dev/null

echo "== router"
"$BIN/kvcm-router" --model "$WORK/model" --run-dir "$RUN" --port 0 >"$WORK/router.log" 2>&1 &
PIDS+=($!)
URL=$(await_line "$WORK/router.log" "ready http=" | sed -E 's/.*ready http=(\S+).*/\1/')
echo "   $URL"

echo "== two executors"
EXECUTORS=()
for i in 0 1; do
  "$BIN/kvcm-executor" --model "$WORK/model" --run-dir "$RUN" --name "exec-$i" --threads 1 \
    --metrics-address 127.0.0.1:0 --fault-layer-delay-ms 2 >"$WORK/executor-$i.log" 2>&1 &
  PIDS+=($!)
  EXECUTORS+=($!)
done
for _ in $(seq 300); do
  if python3 - "$URL" <<'PY'
import json, sys, urllib.request
sys.exit(0 if json.load(urllib.request.urlopen(sys.argv[1] + "/info"))["executors"] == 2 else 1)
PY
  then break; fi
  sleep 0.1
done

echo "== blocks before"
"$BIN/kvcmctl" stats --run-dir "$RUN" | head -9

echo "== requests (one streaming), executor exec-1 killed mid-generation"
python3 scripts/demo_client.py "$URL" --kill-pid "${EXECUTORS[1]}"
grep -h "exited: dropped" "$WORK/router.log" | sed 's/^/   /' || true

echo "== blocks after (the prompts' full blocks stay cached for the next request)"
"$BIN/kvcmctl" stats --run-dir "$RUN" | head -13

echo "== stopping"
stop_all
echo "   all processes stopped; left in the run directory: $(ls -A "$RUN" | tr '\n' ' ')"
echo "   (sockets are removed by their owners; the pool was a memfd: nothing in /dev/shm)"
