#!/usr/bin/env bash
# Makes the Python virtual environments the tests use, from PyPI:
#   BUILD_DIR/venv            the official clients (tests/clients/requirements.txt)
#   BUILD_DIR/venv-reference  the reference implementations the tests compare against
#                             (tests/reference/requirements.txt)
#   BUILD_DIR/venv-monitoring Grafana's dashboard types, for the dashboard checker
#                             (tests/monitoring/requirements.txt)
#   BUILD_DIR/venv-deploy     the Kubernetes schemas and a Compose parser, for the checks of
#                             deploy/ (tests/deploy/requirements.txt)
#   BUILD_DIR/venv-dashboard  Selenium, to drive chromium on the router's /dashboard
#                             (tests/dashboard/requirements.txt)
#   BUILD_DIR/venv-openapi    jsonschema and schemathesis, to check the router's OpenAPI
#                             document and fuzz its API (tests/openapi/requirements.txt)
#   BUILD_DIR/venv-vllm       cbor2, for vLLM's own block hashing functions (read out of its
#                             wheel, not installed) (tests/reference/vllm/requirements.txt)
#   BUILD_DIR/venv-cluster    NVIDIA Dynamo's KV indexer (ai-dynamo-runtime), pyzmq, msgpack,
#                             for the cluster tests (tests/cluster/requirements.txt)
# Two of them because their pins cannot share one (text-generation wants huggingface-hub
# below 1.0, transformers 5 at least 1.0). Each is left alone when it is already there for
# the same requirements. Python never runs inside the services: this is test tooling.
#
#   scripts/python-env.sh                # build/venv, build/venv-reference, build/venv-monitoring,
#                                        # build/venv-deploy, build/venv-dashboard,
#                                        # build/venv-openapi,
#                                        # build/venv-vllm, build/venv-cluster
#   KVCM_BUILD_DIR=out scripts/python-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${KVCM_BUILD_DIR:-build}"

# make_venv DIR REQUIREMENTS LISTED: DIR from REQUIREMENTS; prints the versions of LISTED.
make_venv() {
  local venv="$1" requirements="$2" listed="$3"
  local stamp="$venv/.requirements.sha256"
  local want
  want="$(sha256sum "$requirements" | cut -d' ' -f1)"
  if [[ -x "$venv/bin/python3" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "python-env: $venv is up to date"
    return
  fi
  echo "python-env: installing $(grep -cv '^\s*\(#\|$\)' "$requirements") package(s) into $venv"
  rm -rf "$venv"
  mkdir -p "$BUILD_DIR"
  python3 -m venv "$venv"
  "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check --no-input \
    -r "$requirements"
  echo "$want" > "$stamp"
  "$venv/bin/python3" -m pip list --disable-pip-version-check 2>/dev/null |
    grep -Ei "^($listed) " | sed 's/^/python-env:   /'
}

make_venv "$BUILD_DIR/venv" tests/clients/requirements.txt 'text-generation|openai'
make_venv "$BUILD_DIR/venv-reference" tests/reference/requirements.txt \
  'gguf|numpy|tokenizers|transformers|jinja2'
make_venv "$BUILD_DIR/venv-monitoring" tests/monitoring/requirements.txt \
  'grafana_foundation_sdk|PyYAML'
make_venv "$BUILD_DIR/venv-deploy" tests/deploy/requirements.txt \
  'kubernetes-validate|kubernetes_validate|compose-spec|compose_spec|PyYAML'
make_venv "$BUILD_DIR/venv-dashboard" tests/dashboard/requirements.txt 'selenium'
make_venv "$BUILD_DIR/venv-openapi" tests/openapi/requirements.txt \
  'schemathesis|hypothesis|jsonschema'
make_venv "$BUILD_DIR/venv-vllm" tests/reference/vllm/requirements.txt 'cbor2'
make_venv "$BUILD_DIR/venv-cluster" tests/cluster/requirements.txt 'ai-dynamo-runtime|pyzmq|msgpack'
