#!/usr/bin/env bash
# Builds llama.cpp's llama-batched-bench, the peer bench/model_bench compares the executor's
# model with, or its llama-server, the peer bench/server_vs_llama.py compares the whole
# stack with, from the sources the PyPI sdist of llama-cpp-python carries (the machines
# reach PyPI, not GitHub). Downloads the sdist with `pip download --no-binary`, checks its
# sha256, builds into BUILD_DIR/llama.cpp (CPU only, -march=native) and prints the binary's
# path as the last line. A tree already extracted there from the same sdist is reused, so
# both targets share one build. llama-server is built API only: no web UI (neither npm nor
# the prebuilt one its CMake would download from Hugging Face), no curl; nothing is
# downloaded but the sdist. Benchmark tooling only: kvcm never links llama.cpp.
#
#   scripts/build-llama-cpp.sh                 # then: build/bench/model_bench --llama-batched-bench PATH
#   scripts/build-llama-cpp.sh llama-server    # then: bench/server_vs_llama.py --llama-server PATH
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="${1:-llama-batched-bench}"
case "$TARGET" in
  llama-batched-bench|llama-server) ;;
  *) echo "build-llama-cpp: unknown target '$TARGET' (llama-batched-bench or llama-server)" >&2
     exit 2 ;;
esac

VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
BUILD_DIR="${KVCM_BUILD_DIR:-build}"
DEST="$BUILD_DIR/llama.cpp"
BINARY="$DEST/build/bin/$TARGET"
STAMP="$DEST/.kvcm-sdist-sha256"
JOBS="${KVCM_JOBS:-$(nproc)}"

if [[ -x "$BINARY" ]]; then
  echo "build-llama-cpp: $BINARY is there" >&2
  echo "$BINARY"
  exit 0
fi
# A tree from the same sdist: stamped, or (made before the stamp) holding the batched bench
# only this script builds.
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$SDIST_SHA256" ]] ||
   [[ ! -f "$STAMP" && -x "$DEST/build/bin/llama-batched-bench" && -f "$DEST/CMakeLists.txt" ]]; then
  echo "build-llama-cpp: reusing the llama-cpp-python==$VERSION tree in $DEST" >&2
  echo "$SDIST_SHA256" > "$STAMP"
else
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
  echo "$SDIST_SHA256" > "$STAMP"
fi
SERVER=OFF
if [[ "$TARGET" == llama-server || -x "$DEST/build/bin/llama-server" ]]; then SERVER=ON; fi
cmake -S "$DEST" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER="$SERVER" \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
cmake --build "$DEST/build" -j "$JOBS" --target "$TARGET" >&2
echo "$BINARY"
