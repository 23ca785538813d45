#!/usr/bin/env python3
"""The source tree's layers (docs/architecture.md, "Source map"): every #include "..." of a
file under one top-level folder names a file of the same folder or of a layer below it, and
no service includes another service. Prints each violation; exits 1 if there is one."""

import pathlib
import re
import sys

# Each layer may include itself and the layers before it.
LAYERS = ["common", "kernels", "services", "tools", "bench"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
SOURCES = ("*.h", "*.cc", "*.cu", "*.inc")


def main(root):
    violations = []
    for layer_index, layer in enumerate(LAYERS):
        allowed = set(LAYERS[: layer_index + 1])
        for pattern in SOURCES:
            for path in sorted((root / layer).rglob(pattern)):
                relative = path.relative_to(root)
                for target in INCLUDE.findall(path.read_text(errors="replace")):
                    top = target.split("/", 1)[0]
                    if top not in LAYERS:
                        continue  # generated headers, third-party, same-folder names
                    if top not in allowed:
                        violations.append(f"{relative}: includes {target} ({layer} is below {top})")
                    elif layer == "services" and top == "services":
                        service = relative.parts[1]
                        if target.split("/")[1] != service:
                            violations.append(f"{relative}: includes {target} (one service "
                                              "includes another's)")
    for violation in violations:
        print(violation)
    print(f"check_layers: {len(violations)} violation(s) in {', '.join(LAYERS)}")
    return 1 if violations else 0


def self_test():
    """The check fails on a tree that breaks each rule, and passes one that keeps them."""
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        root = pathlib.Path(directory)
        (root / "common/x").mkdir(parents=True)
        (root / "services/a").mkdir(parents=True)
        (root / "common/x/fine.h").write_text('#include "common/x/other.h"\n#include <vector>\n')
        (root / "services/a/fine.cc").write_text('#include "common/x/fine.h"\n'
                                                '#include "services/a/fine.h"\n')
        if main(root) != 0:
            print("self-test: a tree that keeps the rules failed")
            return 1
        (root / "common/x/up.h").write_text('#include "services/a/fine.h"\n')
        if main(root) != 1:
            print("self-test: an include running back up a layer passed")
            return 1
        (root / "common/x/up.h").unlink()
        (root / "services/a/across.cc").write_text('#include "services/b/other.h"\n')
        if main(root) != 1:
            print("self-test: one service including another's passed")
            return 1
    print("self-test: passed")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
