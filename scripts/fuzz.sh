#!/usr/bin/env bash
# Builds the libFuzzer binary of every fuzz target (cmake/KvcmFuzz.cmake; clang 14 with
# AddressSanitizer and UndefinedBehaviorSanitizer) into BUILD_DIR-fuzz, only those, and runs
# each from its committed seed corpus for KVCM_FUZZ_SECONDS. Any crash, leak, timeout (an
# input taking over 5 s), memory blow-up (over 2 GiB) or undefined behaviour fails the run;
# the input that did it is kept in BUILD_DIR-fuzz/fuzz/artifacts/ and the command that
# replays it is printed. docs/RELIABILITY.md ("Fuzzing") lists the targets and what they
# found.
#
#   scripts/fuzz.sh                               # every target, 25 s each (CI)
#   KVCM_FUZZ_SECONDS=600 scripts/fuzz.sh         # longer
#   KVCM_FUZZ_SECONDS=600 scripts/fuzz.sh gguf    # some targets only, by name
#   KVCM_FUZZ_JOBS=1 scripts/fuzz.sh              # targets run side by side (default: nproc)
#
# Each target's working corpus is BUILD_DIR-fuzz/fuzz/corpus/NAME (kept between runs, so a
# longer run goes on from what the last one found); the seeds in the tree are only read.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${KVCM_BUILD_DIR:-build}"
FUZZ_DIR="$BUILD_DIR-fuzz"
SECONDS_EACH="${KVCM_FUZZ_SECONDS:-25}"
JOBS="${KVCM_JOBS:-$(nproc)}"
PARALLEL="${KVCM_FUZZ_JOBS:-$JOBS}"

started=$(date +%s)
# shellcheck disable=SC2086
# -O1 and line tables only: the instrumented build compiles about twice as fast as at -O2 -g,
# and reports still name files and lines.
OPT="-O1 -gline-tables-only -DNDEBUG"
cmake -S . -B "$FUZZ_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="$OPT" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$OPT" \
  -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DKVCM_FUZZERS=ON \
  -DKVCM_CUDA=OFF -DKVCM_BUILD_BENCHMARKS=OFF ${KVCM_FUZZ_CMAKE_ARGS:-} > /dev/null
cmake --build "$FUZZ_DIR" -j "$JOBS" --target kvcm_fuzzers
built=$(date +%s)
echo "fuzz: built the fuzz targets in $((built - started)) s"

export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:symbolize=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

# The targets: NAME CORPUS DICT (- for none) MAX_LEN, one a line (BUILD_DIR-fuzz/fuzz/targets.tsv).
declare -a names=()
declare -A seeds=() dicts=() max_lens=()
while IFS=$'\t' read -r name corpus dict max_len; do
  if (($# > 0)) && [[ ! " $* " == *" $name "* ]]; then continue; fi
  names+=("$name")
  seeds[$name]="$corpus"
  dicts[$name]="$dict"
  max_lens[$name]="$max_len"
done < "$FUZZ_DIR/fuzz/targets.tsv"
if ((${#names[@]} == 0)); then
  echo "fuzz: no target named $*" >&2
  exit 2
fi

mkdir -p "$FUZZ_DIR/fuzz/logs" "$FUZZ_DIR/fuzz/artifacts"

# run_target NAME: one libFuzzer run; its output in logs/NAME.log, its status in logs/NAME.rc.
run_target() {
  local name="$1"
  local corpus="$FUZZ_DIR/fuzz/corpus/$name"
  mkdir -p "$corpus"
  local args=(-max_total_time="$SECONDS_EACH" -timeout=5 -rss_limit_mb=2048
              -max_len="${max_lens[$name]}" -print_final_stats=1
              -artifact_prefix="$FUZZ_DIR/fuzz/artifacts/$name-")
  if [[ "${dicts[$name]}" != "-" ]]; then args+=(-dict="${dicts[$name]}"); fi
  local status=0
  "$FUZZ_DIR/fuzz/${name}_fuzzer" "${args[@]}" "$corpus" "${seeds[$name]}" \
    > "$FUZZ_DIR/fuzz/logs/$name.log" 2>&1 || status=$?
  echo "$status" > "$FUZZ_DIR/fuzz/logs/$name.rc"
}

echo "fuzz: ${#names[@]} target(s), ${SECONDS_EACH} s each, $PARALLEL at a time"
rm -f "$FUZZ_DIR"/fuzz/logs/*.rc
for name in "${names[@]}"; do
  while (($(jobs -rp | wc -l) >= PARALLEL)); do wait -n || true; done
  run_target "$name" &
done
wait
failed=()
for name in "${names[@]}"; do
  [[ "$(cat "$FUZZ_DIR/fuzz/logs/$name.rc" 2>/dev/null)" == "0" ]] || failed+=("$name")
done

# One line a target: executions, speed, and the coverage at the end (libFuzzer's cov:,
# the edges reached, and ft:, its features).
printf 'fuzz: %-16s %12s %10s %8s %8s %8s\n' target execs execs/s cov ft corpus
for name in "${names[@]}"; do
  log="$FUZZ_DIR/fuzz/logs/$name.log"
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<< "$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<< "$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\)\/.*/\1/p' <<< "$last")
  printf 'fuzz: %-16s %12s %10s %8s %8s %8s\n' "$name" "${execs:-?}" "${speed:-?}" \
    "${cov:-?}" "${ft:-?}" "${corp:-?}"
done

for name in "${failed[@]}"; do
  echo "---- fuzz: $name failed; the end of $FUZZ_DIR/fuzz/logs/$name.log:"
  tail -n 60 "$FUZZ_DIR/fuzz/logs/$name.log"
  for artifact in "$FUZZ_DIR/fuzz/artifacts/$name-"*; do
    [[ -e "$artifact" ]] || continue
    echo "fuzz: replay with: $FUZZ_DIR/fuzz/${name}_fuzzer $artifact"
  done
done
echo "fuzz: $((${#names[@]} - ${#failed[@]})) passed, ${#failed[@]} failed in $(($(date +%s) - started)) s"
((${#failed[@]} == 0))
