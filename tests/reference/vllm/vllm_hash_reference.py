#!/usr/bin/env python3
"""vLLM's own sha256_cbor block hashes, for tests/common/block/vllm_hash_reference_test.cc.

vLLM is not installed (it needs torch and a GPU stack): vllm/utils/hashing.py is imported as
it is (it needs only cbor2), and from vllm/v1/core/kv_cache_utils.py the definitions that
compute a block hash (hash_block_tokens, init_none_hash, resolve_none_hash_seed,
maybe_convert_block_hash and the constants they read) are taken out of the file's syntax
tree and run unchanged. Both files come out of the vLLM wheel on PyPI, read by range
(pypi_wheel_members.py) and cached under --cache.

    vllm_hash_reference.py --cache DIR IN.json OUT.json

IN.json: {"cases": [{"seed": str|null, "block_size": N, "tokens": [int...],
                     "extra_keys": [[str...]|null per full block] (optional)}]}
   seed: the PYTHONHASHSEED vLLM runs with (null: unset, so NONE_HASH is sha256_cbor of
   "vllm-none-hash").
OUT.json: {"vllm_version": str, "cases": [{"none_hash": hex, "hashes": [hex per full block],
                                            "ids": [int per full block]}]}
   ids: maybe_convert_block_hash with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the 64-bit ids of
   vLLM's KV events.
"""

import __future__
import argparse
import ast
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, NewType, TypeAlias

VLLM_VERSION = "0.33.0"
PLATFORM = "manylinux_2_28_x86_64"  # the pure-Python files are the same in every wheel
HASHING = "vllm/utils/hashing.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"
# What is taken out of kv_cache_utils.py, by name.
FUNCTIONS = {"hash_block_tokens", "init_none_hash", "resolve_none_hash_seed",
             "maybe_convert_block_hash"}
CONSTANTS = {"BlockHash", "ExternalBlockHash", "DEFAULT_NONE_HASH_SEED",
             "_NON_CRYPTO_HASH_FUNCTIONS", "_NONE_HASH_SEED"}


def fetch_members(cache):
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, os.path.join(here, "pypi_wheel_members.py"), "--project", "vllm",
         "--version", VLLM_VERSION, "--platform", PLATFORM, "--cache", cache, HASHING,
         KV_CACHE_UTILS],
        check=True, stdout=subprocess.PIPE, text=True).stdout.split()
    return out[0], out[1]


def load_vllm(hashing_path, utils_path):
    spec = importlib.util.spec_from_file_location("vllm_utils_hashing", hashing_path)
    hashing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hashing)

    with open(utils_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), utils_path)
    kept = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            kept.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in CONSTANTS for t in targets):
                kept.append(node)
    found = {n.name for n in kept if isinstance(n, ast.FunctionDef)}
    if found != FUNCTIONS:
        raise RuntimeError(f"{utils_path} lacks {sorted(FUNCTIONS - found)}")
    module = ast.Module(body=kept, type_ignores=[])
    namespace = {
        "__name__": "vllm_kv_cache_utils",
        "os": os, "Any": Any, "Callable": Callable, "Sequence": Sequence,
        "NewType": NewType, "TypeAlias": TypeAlias,
        "xxhash": hashing.xxhash, "xxhash_cbor": hashing.xxhash_cbor,
        "logger": logging.getLogger("vllm"),
        "envs": SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True),
    }
    exec(compile(module, utils_path, "exec", flags=__future__.annotations.compiler_flag,
                 dont_inherit=True), namespace)  # noqa: S102 (vLLM's own code)
    return hashing, namespace


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True)
    parser.add_argument("input")
    parser.add_argument("output")
    args = parser.parse_args()
    hashing, utils = load_vllm(*fetch_members(args.cache))
    sha256_cbor = hashing.get_hash_fn_by_name("sha256_cbor")

    with open(args.input, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    results = []
    for case in cases:
        if case["seed"] is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = case["seed"]
        utils["init_none_hash"](sha256_cbor)
        block_size = case["block_size"]
        tokens = case["tokens"]
        extra = case.get("extra_keys")
        parent = None
        hashes = []
        for i in range(len(tokens) // block_size):
            keys = extra[i] if extra is not None else None
            keys = tuple(keys) if keys is not None else None
            parent = utils["hash_block_tokens"](
                sha256_cbor, parent, tokens[i * block_size:(i + 1) * block_size], keys)
            hashes.append(parent)
        results.append({
            "none_hash": utils["NONE_HASH"].hex(),
            "hashes": [h.hex() for h in hashes],
            "ids": [utils["maybe_convert_block_hash"](h) for h in hashes],
        })
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"vllm_version": VLLM_VERSION, "cases": results}, f)
    print(f"vllm_hash_reference: {len(results)} case(s) hashed by vLLM {VLLM_VERSION}'s "
          f"hash_block_tokens with sha256_cbor")


if __name__ == "__main__":
    main()
