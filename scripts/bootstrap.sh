#!/usr/bin/env bash
# Installs the Debian packages kvcm needs to build and test (only those missing, without
# questions), then configures and builds.
#
#   scripts/bootstrap.sh                 # packages + configure + build into build/
#   KVCM_BUILD_DIR=out scripts/bootstrap.sh
#   KVCM_SKIP_BUILD=1 scripts/bootstrap.sh   # packages only
#   KVCM_CMAKE_ARGS="-DKVCM_SANITIZE=address,undefined" scripts/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Everything the build, the tests and the benchmarks use; one line each so that a reader
# knows why it is here.
PACKAGES=(
  build-essential            # g++ 12, make
  cmake                      # 3.25
  ninja-build
  ccache                     # every build compiles through it (CMakeLists.txt): a rebuild of
                             # the same sources, in any clone, is a cache hit
  pkg-config
  git
  libabsl-dev                # Status/StatusOr, flat_hash_map, flags, strings
  libssl-dev                 # SHA-256 for block hashes
  libxxhash-dev              # XXH3-128, the default block hash (header-only use)
  flatbuffers-compiler       # flatc: schemas/ -> generated headers in the build tree
  libflatbuffers-dev
  libzmq3-dev                # ZeroMQ transport
  cppzmq-dev
  libmsgpack-cxx-dev         # msgpack: the cache manager's vLLM-format KV events (header-only)
  prometheus-cpp-dev         # /metrics
  prometheus                 # prometheus + promtool: integration tests scrape and lint /metrics
  nlohmann-json3-dev         # Hugging Face config.json
  libyaml-cpp-dev            # common/config: the --config YAML file of every binary
  libsentencepiece-dev       # common/tokenizer: SentencePiece tokenizer.model
  libpcre2-dev               # common/tokenizer: byte-level BPE pre-tokenizer regexes (JIT)
  libicu-dev                 # common/tokenizer: Unicode NFC for tokenizer.json normalizers
  libevent-dev               # the router's HTTP server (evhttp: an open stream costs no thread)
  liburing-dev               # the disk tier's reads, several in flight per mover (io_uring)
  libgtest-dev               # tests
  libgmock-dev
  libbenchmark-dev           # bench/
  python3                    # test tooling
  python3-venv               # scripts/python-env.sh: the official clients the tests use
  systemd                    # systemd-analyze verify, systemd-sysusers: tests/deploy on deploy/systemd/
  strace                     # tests/deploy: a running stack's system calls against the units' filter
  chromium                   # tests/dashboard: the router's /dashboard in a real browser, headless
  chromium-driver            # tests/dashboard: chromedriver, through which Selenium drives it
  clang                      # clang 14: the sanitizer builds of scripts/test.sh, -Wthread-safety
  libclang-rt-14-dev         # its sanitizer and libFuzzer runtimes (scripts/fuzz.sh; only
                             # recommended by clang)
  llvm-14                    # llvm-symbolizer: source lines in sanitizer reports
  clang-format-14            # scripts/format.sh: the format check scripts/test.sh runs first
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]})); then
  echo "bootstrap: installing ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "bootstrap: all ${#PACKAGES[@]} packages present"
fi

if [[ "${KVCM_SKIP_BUILD:-0}" == "1" ]]; then exit 0; fi

BUILD_DIR="${KVCM_BUILD_DIR:-build}"
JOBS="${KVCM_JOBS:-$(nproc)}"
# ccache: paths under the checkout are hashed relative to it, and the compiler's working
# directory not at all, so that a clone in another folder (CI's) hits what this one compiled.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
# Four builds of the tree (normal, fuzz, ASan+UBSan, TSan) with debug information.
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-20G}"
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${KVCM_BUILD_TYPE:-RelWithDebInfo}" \
  ${KVCM_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
