#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: builds kvcm with CUDA (KVCM_CUDA=ON,
# Release, in build-gpu/), runs every ctest labelled `gpu` and every GPU benchmark
# (build-gpu/bench/*gpu*, if any), and fails if a gpu test failed or was skipped: on a GPU
# machine a skip means the device was not usable, which is the failure to report. The gpu
# tests run with KVCM_REQUIRE_GPU=1, which makes ours fail rather than skip.
#
#   scripts/gpu-check.sh
#   KVCM_JOBS=8 KVCM_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native" scripts/gpu-check.sh
#   KVCM_SKIP_BUILD=1 scripts/gpu-check.sh        # tests and benchmarks of an existing build
#   KVCM_GPU_BUILD_DIR=out scripts/gpu-check.sh
#
# Installs nothing (GPU machines often have no network): cmake, ninja, nvcc and the Debian
# packages listed in scripts/bootstrap.sh must already be there.
# Time: the build is a few minutes from scratch on 16 cores (less when build-gpu/ exists);
# the gpu tests take seconds; benchmarks add their own run time.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${KVCM_GPU_BUILD_DIR:-build-gpu}"
JOBS="${KVCM_JOBS:-$(nproc)}"

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || echo "gpu-check: nvidia-smi -L failed"
else
  echo "gpu-check: nvidia-smi not found"
fi

if [[ "${KVCM_SKIP_BUILD:-0}" != "1" ]]; then
  for tool in cmake ninja; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "gpu-check: $tool not found (scripts/bootstrap.sh lists what kvcm needs)" >&2
      exit 1
    fi
  done
  # shellcheck disable=SC2086
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCM_CUDA=ON \
    ${KVCM_CMAKE_ARGS:-}
  cmake --build "$BUILD_DIR" -j "$JOBS"
fi

failed=0

# One test at a time: they share the one device.
log="$BUILD_DIR/gpu-check-ctest.log"
echo "gpu-check: ctest -L gpu in $BUILD_DIR"
if ! KVCM_REQUIRE_GPU=1 ctest --test-dir "$BUILD_DIR" -L gpu --no-tests=error \
    --output-on-failure --timeout 600 2>&1 | tee "$log"; then
  echo "gpu-check: gpu tests FAILED" >&2
  failed=1
fi
# ctest exits 0 when tests are skipped; here a skip is a failure.
if grep -q -e '(Skipped)' -e '\[  SKIPPED \]' "$log"; then
  echo "gpu-check: gpu tests were SKIPPED on a machine that should have a GPU:" >&2
  grep -e '(Skipped)' "$log" >&2 || true
  failed=1
fi

# Tests that take a GPU path only when there is a device, without the gpu label (they
# run in CI too): that no log carries the CUDA IPC handle of a real CUDA pool.
if ! KVCM_REQUIRE_GPU=1 ctest --test-dir "$BUILD_DIR" --no-tests=error --output-on-failure \
    --timeout 600 -R '^CacheManagerSecurityTest\.TheLogNeverCarriesTheTcpSecretOrThePoolsHandles$'; then
  echo "gpu-check: the log check with a CUDA pool FAILED" >&2
  failed=1
fi

shopt -s nullglob
benches=()
for path in "$BUILD_DIR"/bench/*gpu*; do
  if [[ -f "$path" && -x "$path" ]]; then benches+=("$path"); fi
done
if ((${#benches[@]} == 0)); then
  echo "gpu-check: no GPU benchmarks in $BUILD_DIR/bench"
fi
for bench in "${benches[@]}"; do
  echo "gpu-check: $bench"
  # shellcheck disable=SC2086
  if ! "$bench" ${KVCM_BENCH_ARGS:-}; then
    echo "gpu-check: benchmark $bench FAILED" >&2
    failed=1
  fi
done

if ((failed)); then
  echo "gpu-check: FAILED" >&2
  exit 1
fi
echo "gpu-check: OK"
