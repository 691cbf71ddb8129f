"""Goodput of a real restart: it loads its train call from the run's persistent compilation cache."""


from support.cli import SMALL, read_jsonl, run_cli


def test_a_new_run_loads_the_train_call_from_the_users_compilation_cache(tmp_path, shakespeare):
    """The default: no JAX_COMPILATION_CACHE_DIR and a local run directory, so the cache is the user's
    ~/.cache/gpt2_nnx/compile_cache: the first attempt of a new run in another directory loads its train call from
    it (a fresh home: the session's other runs leave nothing in it), and so would a restart, from the same place."""
    home = tmp_path / "home"
    env = {"JAX_COMPILATION_CACHE_DIR": "", "HOME": str(home)}
    flags = [f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=4", "--checkpoint.every=2",
             "--train.eval_every=0"]
    for run_dir in (tmp_path / "run", tmp_path / "other"):
        r = run_cli("train.py", "--run_dir", str(run_dir), *flags, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    assert (home / ".cache" / "gpt2_nnx" / "compile_cache").is_dir()
    assert not (tmp_path / "run" / "compile_cache").exists()

    def train_call_hits(run_dir):
        return [(c["attempt"], c["cache_hits"].get("jit(call)", 0)) for c in read_jsonl(run_dir / "events.jsonl")
                if c["event"] == "interval" and c["kind"] == "compile" and "jit(call)" in c["programs"]]

    assert train_call_hits(tmp_path / "run") == [(1, 0)]
    assert train_call_hits(tmp_path / "other") == [(1, 1)]
    assert "goodput " in r.stdout and "loaded from the persistent cache" in r.stdout
