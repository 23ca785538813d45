#!/usr/bin/env bash
# Builds llama.cpp's llama-batched-bench, the peer bench/model_bench compares the executor's
# model with, from the sources the PyPI sdist of llama-cpp-python carries (the machines
# reach PyPI, not GitHub). Downloads the sdist with `pip download --no-binary`, checks its
# sha256, builds into BUILD_DIR/llama.cpp (CPU only, -march=native) and prints the binary's
# path as the last line. Benchmark tooling only: kvcm never links llama.cpp.
#
#   scripts/build-llama-cpp.sh        # then: build/bench/model_bench --llama-batched-bench PATH
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
BUILD_DIR="${KVCM_BUILD_DIR:-build}"
DEST="$BUILD_DIR/llama.cpp"
BINARY="$DEST/build/bin/llama-batched-bench"
JOBS="${KVCM_JOBS:-$(nproc)}"

if [[ -x "$BINARY" ]]; then
  echo "build-llama-cpp: $BINARY is there" >&2
  echo "$BINARY"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
echo "build-llama-cpp: downloading llama-cpp-python==$VERSION (sdist) from PyPI" >&2
"$work/venv/bin/pip" download --quiet --disable-pip-version-check --no-input --no-deps \
  --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
echo "$SDIST_SHA256  $work/$SDIST" | sha256sum --check --quiet - >&2 || {
  echo "build-llama-cpp: $SDIST does not have the expected sha256" >&2
  exit 1
}
tar -xzf "$work/$SDIST" -C "$work"
rm -rf "$DEST"
mkdir -p "$BUILD_DIR"
mv "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
cmake -S "$DEST" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$DEST/build" -j "$JOBS" --target llama-batched-bench >&2
echo "$BINARY"
