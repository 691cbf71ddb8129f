"""What `pip install .` ships: the wheel built from the sources, installed into a fresh environment outside the
checkout, runs the three programs and imports every package they use from its own copy (an editable install run
from the checkout would hide a package or module the wheel leaves out)."""

import shutil
import subprocess
import site as running_site
import sys

from support.cli import ROOT, cli_env

PACKAGES = ("gpt2", "data", "configs", "optim", "trainer", "planning", "tools", "benchmarks")
MODULES = ("train", "eval", "plan", "errors", "fields")


def test_the_wheel_installs_whole_and_its_programs_run_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # a copy, so that building writes nothing into the checkout (build/, *.egg-info)
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                                "__pycache__", "tests", "docs"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("gpt2_nnx-*.whl")
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    subprocess.run([*pip, "--python", str(env / "bin" / "python"), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    # the dependencies are this venv's, as a plain path: its .pth files (the editable install's finder) stay unread
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text("\n".join(running_site.getsitepackages()) + "\n")
    run = lambda *args: subprocess.run(args, cwd=tmp_path, env=cli_env(1), capture_output=True, text=True,  # noqa: E731
                                       timeout=300)
    for program in ("gpt2-train", "gpt2-eval", "gpt2-plan"):
        r = run(str(env / "bin" / program), "--help")
        assert r.returncode == 0 and "usage:" in r.stdout, (program, r.stderr[-2000:])
    names = ", ".join(PACKAGES + MODULES)
    code = (f"import {names}; from data.tokenizer import get_tokenizer;"
            f" print(get_tokenizer().encode('Hello world'));"
            f" print('\\n'.join(m.__file__ for m in ({names},)))")
    r = run(str(env / "bin" / "python"), "-c", code)
    assert r.returncode == 0, r.stderr[-2000:]
    tokens, *files = r.stdout.strip().splitlines()
    assert tokens == "[15496, 995]"  # the rank file shipped as package data
    assert len(files) == len(PACKAGES + MODULES) and all(f.startswith(str(site)) for f in files), files
