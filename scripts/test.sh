#!/usr/bin/env bash
# Installs what is missing (Debian packages, and the official Python clients into
# BUILD_DIR/venv), builds, and runs the whole test suite through ctest.
#
#   scripts/test.sh                  # everything (gpu tests skip without a device)
#   scripts/test.sh -L unit          # extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/bootstrap.sh
scripts/python-env.sh

BUILD_DIR="${KVCM_BUILD_DIR:-build}"
JOBS="${KVCM_JOBS:-$(nproc)}"
echo "test: ctest with $JOBS jobs in $BUILD_DIR"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" --timeout 600 "$@"
