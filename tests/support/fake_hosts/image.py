"""A host image's own programs, as unkind as the Cloud TPU VM images (Ubuntu 22.04): `python3` is 3.10, has pip but
no venv module (python3-venv is not installed, so ensurepip is missing), and runs nothing of the project's (which
needs >= 3.11). `python3 -m pip install --user uv==V` puts a stand-in for uv in ~/.local/bin, as pip's user scheme
does:
- `uv venv --python 3.11 PATH` makes an environment whose python is the tests' interpreter (it has the packages),
  refusing an existing directory without --allow-existing (uv >= 0.8) and a Python older than 3.11;
- `uv pip install ...` records its arguments in <cloud>/pip.log and installs nothing, or fails as a package index
  that answers 503 does, on the hosts FakeCloud.fail_install names (once, or always).
Run as `image.py python3 ARGS` / `image.py uv ARGS` (the scripts FakeCloud writes)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
from pathlib import Path

IMAGE_PYTHON = "3.10.12"
NO_VENV = """The virtual environment was not created successfully because ensurepip is not
available.  On Debian/Ubuntu systems, you need to install the python3-venv
package using the following command.

    apt install python3.10-venv

You may need to use sudo with that command.  After installing the python3-venv
package, recreate your virtual environment."""
INDEX_DOWN = """error: Request failed after 3 retries
  Caused by: Failed to fetch: `https://pypi.org/simple/jax/`
  Caused by: HTTP status server error (503 Service Unavailable) for url (https://pypi.org/simple/jax/)"""


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def python3(argv: list[str]) -> int:
    if argv[:1] in (["--version"], ["-V"]):
        print(f"Python {IMAGE_PYTHON}")
        return 0
    if argv[:2] == ["-m", "venv"]:
        print(NO_VENV, file=sys.stderr)
        return 1
    if argv[:3] == ["-m", "pip", "install"] and "--user" in argv and any(a.startswith("uv==") for a in argv):
        _script(Path.home() / ".local" / "bin" / "uv", f'exec {sys.executable} {Path(__file__).resolve()} uv "$@"\n')
        return 0
    print(f"fake image python3 {IMAGE_PYTHON}: {argv[:3]}: this project needs Python >= 3.11", file=sys.stderr)
    return 1


def uv(argv: list[str]) -> int:
    if argv[:1] == ["venv"]:
        return _venv(argv[1:])
    if argv[:2] == ["pip", "install"]:
        return _pip_install(argv[2:])
    print(f"fake uv: unsupported: {argv}", file=sys.stderr)
    return 2


def _venv(argv: list[str]) -> int:
    python = argv[argv.index("--python") + 1] if "--python" in argv else IMAGE_PYTHON
    path = Path([a for a in argv if not a.startswith("-") and a != python][-1])
    if not re.fullmatch(r"3\.(1[1-9]|[2-9]\d)(\.\d+)?", python):
        print(f"error: the project needs Python >= 3.11; `uv venv --python {python}` found {python}", file=sys.stderr)
        return 2
    if path.exists() and any(path.iterdir()) and "--allow-existing" not in argv:
        print(f"error: Failed to create virtual environment\n  Caused by: A directory already exists at: {path}",
              file=sys.stderr)
        return 2
    _script(path / "bin" / "python", f'exec {sys.executable} "$@"\n')
    return 0


def _pip_install(argv: list[str]) -> int:
    root = Path(os.environ.get("FAKE_CLOUD_ROOT", "."))
    if _index_down_for(root, os.environ.get("HOSTNAME", "")):
        print(INDEX_DOWN, file=sys.stderr)
        return 2
    with open(root / "pip.log", "a") as f:
        f.write(" ".join(argv) + "\n")
    return 0


def _index_down_for(root: Path, host: str) -> bool:
    """FakeCloud.fail_install: whether this host's install fails this time (a count left, or -1: always)."""
    path = root / "install_faults.json"
    if not path.exists():
        return False
    with open(root / "install_faults.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        faults = json.loads(path.read_text())
        left = faults.get(host, 0)
        if left > 0:
            faults[host] = left - 1
            path.write_text(json.dumps(faults))
    return left != 0


if __name__ == "__main__":
    sys.exit({"python3": python3, "uv": uv}[sys.argv[1]](sys.argv[2:]))
