#!/usr/bin/env bash
# Installs what is missing (Debian packages; the official Python clients and the reference
# implementations into BUILD_DIR/venv*; the bundled real model), builds, and runs the whole
# test suite through ctest. Then the sanitizer stages (docs/RELIABILITY.md, "Sanitizers"):
# the whole suite again built with clang under AddressSanitizer + UndefinedBehaviorSanitizer
# in BUILD_DIR-asan (the same build is the -Wthread-safety -Werror check), and the tests
# labelled tsan built under ThreadSanitizer in BUILD_DIR-tsan.
#
#   scripts/test.sh                  # everything (gpu tests skip without a device)
#   scripts/test.sh -L unit          # extra arguments go to every ctest run
#   KVCM_SANITIZERS=0 scripts/test.sh        # the normal suite only, for a quick local run
#   KVCM_SANITIZERS=all scripts/test.sh      # and both stages (the default, what CI runs)
#   KVCM_SANITIZERS=tsan scripts/test.sh     # the TSan stage only; =asan: the ASan stage only
#   KVCM_SOAK=1 KVCM_SANITIZERS=0 KVCM_FUZZ=0 scripts/test.sh -L soak
#                                            # the soak alone (label soak, ten minutes:
#                                            # docs/RELIABILITY.md "Soak"); every run leaves
#                                            # it out without KVCM_SOAK=1
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's time, printed as it ends (docs/RELIABILITY.md, "CI time").
STAGE_START=$SECONDS
stage_done() {
  echo "test: stage $1 took $((SECONDS - STAGE_START)) s (${SECONDS} s in all)"
  STAGE_START=$SECONDS
}

# ccache for every build below (scripts/bootstrap.sh says why these settings).
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-20G}"
scripts/bootstrap.sh
stage_done "packages and build"
# Every C++ and CUDA file as clang-format writes it (scripts/format.sh rewrites them).
scripts/format.sh --check
scripts/python-env.sh
# The real models, for the tests that run them; they find them through these variables.
KVCM_SMOLLM2_GGUF="$(scripts/get-model.sh)"
KVCM_GEMMA3_GGUF="$(scripts/get-model.sh gemma3-270m)"
export KVCM_SMOLLM2_GGUF KVCM_GEMMA3_GGUF
stage_done "python environments and model"

BUILD_DIR="${KVCM_BUILD_DIR:-build}"
JOBS="${KVCM_JOBS:-$(nproc)}"

# Labels every ctest run leaves out: soak (ten minutes, tests/faults/soak_test.cc) unless
# KVCM_SOAK=1.
EXCLUDED=""
[[ "${KVCM_SOAK:-0}" == "1" ]] || EXCLUDED="soak"

# with_excluded REGEX ARGS...: CTEST_ARGS becomes ARGS with one -LE of REGEX and the regex
# of every -LE/--label-exclude in ARGS joined (ctest 3.25 honours no exclusion at all when
# given two), so that a caller's -LE adds to the stage's instead of undoing it.
with_excluded() {
  local regex="$1"
  shift
  CTEST_ARGS=()
  while (($#)); do
    if [[ ("$1" == "-LE" || "$1" == "--label-exclude") && $# -ge 2 ]]; then
      regex="${regex:+$regex|}$2"
      shift 2
      continue
    fi
    CTEST_ARGS+=("$1")
    shift
  done
  [[ -z "$regex" ]] || CTEST_ARGS+=(-LE "$regex")
}

echo "test: ctest with $JOBS jobs in $BUILD_DIR"
with_excluded "$EXCLUDED" "$@"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" --timeout 600 "${CTEST_ARGS[@]}"
stage_done "tests"

# ---- Fuzzing (scripts/fuzz.sh, docs/RELIABILITY.md "Fuzzing") ----------------------------
# A short libFuzzer run of every fuzz target, built in BUILD_DIR-fuzz. KVCM_FUZZ=0 skips it;
# KVCM_FUZZ_SECONDS sets the time of each target (25 s by default).
if [[ "${KVCM_FUZZ:-1}" != "0" ]]; then
  scripts/fuzz.sh
  stage_done "fuzz (build and run)"
fi
# ---- end of fuzzing -------------------------------------------------------------------------

SANITIZERS="${KVCM_SANITIZERS:-all}"
[[ "$SANITIZERS" == "0" ]] && exit 0

# Tests excluded from every sanitizer stage, by label (tests/CMakeLists.txt says why each
# label's tests cannot run there): gpu needs a device and CUDA, which these builds lack; soak
# measures resident memory, which a sanitizer's own allocator (ASan's quarantine) decides.
SANITIZER_EXCLUDED="gpu|no_sanitizer|soak"

# configure_sanitized DIR SANITIZERS: a clang build with -DKVCM_SANITIZE=SANITIZERS, no CUDA
# and no benchmarks; the Python environments are BUILD_DIR's.
configure_sanitized() {
  local dir="$1" sanitizers="$2"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DKVCM_SANITIZE="$sanitizers" \
    -DKVCM_CUDA=OFF -DKVCM_BUILD_BENCHMARKS=OFF ${KVCM_SANITIZER_CMAKE_ARGS:-}
  local venv
  for venv in "$BUILD_DIR"/venv*; do
    [[ -e "$venv" ]] || continue
    ln -sfn "$(realpath "$venv")" "$dir/$(basename "$venv")"
  done
}

# run_sanitized NAME DIR CTEST_ARGS...: ctest with the sanitizers' reports written under
# DIR/sanitizer-reports (one file per process, so that a report of a process that a test
# started, and whose exit status it does not look at, is not lost); any report fails the
# stage after it is printed.
run_sanitized() {
  local name="$1" dir="$2"
  shift 2
  local reports="$dir/sanitizer-reports"
  rm -rf "$reports"
  mkdir -p "$reports"
  local status=0
  echo "test: $name: ctest with $JOBS jobs in $dir"
  ctest --test-dir "$dir" --output-on-failure -j "$JOBS" --timeout 600 "$@" || status=$?
  if compgen -G "$reports/*" > /dev/null; then
    echo "test: $name: sanitizer reports:"
    local report
    for report in "$reports"/*; do
      echo "---- $report"
      cat "$report"
    done
    status=1
  fi
  return "$status"
}

SUPPRESSIONS="$PWD/tests/sanitizers"
export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
export TSAN_SYMBOLIZER_PATH="$ASAN_SYMBOLIZER_PATH"

if [[ "$SANITIZERS" == "all" || "$SANITIZERS" == "asan" ]]; then
  ASAN_DIR="$(realpath -m "$BUILD_DIR-asan")"
  configure_sanitized "$ASAN_DIR" address,undefined
  cmake --build "$ASAN_DIR" -j "$JOBS"
  stage_done "asan build"
  (
    export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:check_initialization_order=1:log_path=$ASAN_DIR/sanitizer-reports/asan"
    export LSAN_OPTIONS="suppressions=$SUPPRESSIONS/lsan.supp"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPPRESSIONS/ubsan.supp:log_path=$ASAN_DIR/sanitizer-reports/ubsan"
    with_excluded "$SANITIZER_EXCLUDED|no_asan" "$@"
    run_sanitized asan "$ASAN_DIR" "${CTEST_ARGS[@]}"
  )
  stage_done "asan tests"
fi

if [[ "$SANITIZERS" == "all" || "$SANITIZERS" == "tsan" ]]; then
  TSAN_DIR="$(realpath -m "$BUILD_DIR-tsan")"
  configure_sanitized "$TSAN_DIR" thread
  cmake --build "$TSAN_DIR" -j "$JOBS" --target kvcm_tsan_tests
  stage_done "tsan build"
  (
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPPRESSIONS/tsan.supp:log_path=$TSAN_DIR/sanitizer-reports/tsan"
    with_excluded "$SANITIZER_EXCLUDED" -L tsan "$@"
    run_sanitized tsan "$TSAN_DIR" "${CTEST_ARGS[@]}"
  )
  stage_done "tsan tests"
fi
