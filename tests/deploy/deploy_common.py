"""What the deployment checks (tests/deploy/check_*.py) share: a list of failures, the flags
each kvcm binary accepts (from its own --helpfull), and the project's version.

Each checker prints one line per check it makes and exits 1 naming every failure, 0 when
there is none.
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Checks:
    def __init__(self, name: str):
        self.name = name
        self.failures: list[str] = []
        self.count = 0

    def check(self, ok: bool, what: str) -> bool:
        self.count += 1
        if not ok:
            self.failures.append(what)
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        return ok

    def done(self) -> int:
        if self.failures:
            print(f"{self.name}: {len(self.failures)} of {self.count} checks failed")
            return 1
        print(f"{self.name}: all {self.count} checks passed")
        return 0


_flags_cache: dict[str, set[str]] = {}


def known_flags(binary: pathlib.Path) -> set[str]:
    """The flags `binary` accepts, spelled with dashes (--run-dir), from its --helpfull."""
    key = str(binary)
    if key not in _flags_cache:
        out = subprocess.run([str(binary), "--helpfull"], capture_output=True, text=True,
                             timeout=30)
        text = out.stdout + out.stderr
        names = {m.group(1).replace("_", "-") for m in re.finditer(r"^\s+--([A-Za-z0-9_]+) \(",
                                                                    text, re.MULTILINE)}
        if not names:
            sys.exit(f"{binary} --helpfull listed no flags (exit {out.returncode}): {text[:300]}")
        _flags_cache[key] = names
    return _flags_cache[key]


def kvcmctl_flags(binary: pathlib.Path, command: str) -> set[str]:
    """The flags of `kvcmctl COMMAND`, from `kvcmctl COMMAND --help`."""
    out = subprocess.run([str(binary), command, "--help"], capture_output=True, text=True,
                         timeout=30)
    names = set(re.findall(r"^\s+--([a-z0-9-]+)", out.stdout + out.stderr, re.MULTILINE))
    if not names:
        sys.exit(f"{binary} {command} --help listed no flags (exit {out.returncode})")
    return names


def flags_in(argv: list[str]) -> list[str]:
    """The flag names (without --, dashed) in a command line."""
    return [arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--") and len(arg) > 2]


def check_command(checks: Checks, where: str, argv: list[str], bin_dir: pathlib.Path) -> None:
    """argv[0] is a kvcm binary of the build (by name) and every flag in argv is one of its."""
    name = pathlib.PurePath(argv[0]).name
    binary = bin_dir / name
    if not checks.check(binary.exists(), f"{where}: runs {name}, which the build has ({binary})"):
        return
    if name == "kvcmctl":  # kvcmctl COMMAND [flags]: each command lists its own flags
        accepted = kvcmctl_flags(binary, argv[1])
        argv = argv[1:]
    else:
        accepted = known_flags(binary)
    unknown = [f for f in flags_in(argv[1:]) if f.replace("_", "-") not in accepted]
    checks.check(not unknown, f"{where}: every flag of {name} is one it accepts"
                              + (f" (not: {', '.join(unknown)})" if unknown else ""))


def project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(kvcm VERSION ([0-9.]+)", text)
    assert match, "CMakeLists.txt has no project(kvcm VERSION ...)"
    return match.group(1)


def dockerfile_user() -> str:
    """The USER of deploy/docker/Dockerfile's last stage (uid:gid)."""
    users = re.findall(r"^USER\s+(\S+)", (ROOT / "deploy/docker/Dockerfile").read_text(),
                       re.MULTILINE)
    return users[-1] if users else ""
