#!/usr/bin/env bash
# Installs what is missing (Debian packages; the official Python clients and the reference
# implementations into BUILD_DIR/venv*; the bundled real model), builds, and runs the whole
# test suite through ctest.
#
#   scripts/test.sh                  # everything (gpu tests skip without a device)
#   scripts/test.sh -L unit          # extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/bootstrap.sh
scripts/python-env.sh
# The bundled real model, for the tests that run it; they find it through this variable.
KVCM_SMOLLM2_GGUF="$(scripts/get-model.sh)"
export KVCM_SMOLLM2_GGUF

BUILD_DIR="${KVCM_BUILD_DIR:-build}"
JOBS="${KVCM_JOBS:-$(nproc)}"
echo "test: ctest with $JOBS jobs in $BUILD_DIR"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" --timeout 600 "$@"

# ---- Fuzzing (scripts/fuzz.sh, docs/RELIABILITY.md "Fuzzing") ----------------------------
# A short libFuzzer run of every fuzz target, built in BUILD_DIR-fuzz. KVCM_FUZZ=0 skips it;
# KVCM_FUZZ_SECONDS sets the time of each target (25 s by default).
if [[ "${KVCM_FUZZ:-1}" != "0" ]]; then
  scripts/fuzz.sh
fi
# ---- end of fuzzing -------------------------------------------------------------------------
