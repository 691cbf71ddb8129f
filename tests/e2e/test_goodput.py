"""Goodput of a real restart: it loads its train call from the run's persistent compilation cache."""


from support.cli import SMALL, read_jsonl, run_cli


def test_a_restart_loads_its_train_call_from_the_runs_compilation_cache(tmp_path, shakespeare):
    """The default: no JAX_COMPILATION_CACHE_DIR, so the cache is the run directory's compile_cache/."""
    run_dir = tmp_path / "run"
    flags = ["--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *SMALL, "--train.steps=4",
             "--checkpoint.every=2", "--train.eval_every=0"]
    for extra in (["--train.stop_after=2"], []):
        r = run_cli("train.py", *flags, *extra, env={"JAX_COMPILATION_CACHE_DIR": ""})
        assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "compile_cache").is_dir()
    train_call = [r for r in read_jsonl(run_dir / "events.jsonl")
                  if r["event"] == "interval" and r["kind"] == "compile" and "jit(call)" in r["programs"]]
    assert [(c["attempt"], c["cache_hits"].get("jit(call)", 0)) for c in train_call] == [(1, 0), (2, 1)]
    assert "goodput " in r.stdout and "loaded from the persistent cache" in r.stdout
