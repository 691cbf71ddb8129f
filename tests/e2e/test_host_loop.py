"""train.py's host loop: call n+1 is dispatched before call n's metrics are read, and nothing a run produces
depends on it (the loop that waits after every call is the reference)."""

import jax
import numpy as np
import orbax.checkpoint as ocp

import train as train_app
from support.cli import SMALL, checkpoint_steps, read_jsonl, run_main, without_timing
from trainer.run.context import RunContext
from trainer.run.loop import TrainingLoop

# calls of 2 steps; an evaluation every 4 and a checkpoint every 6 steps: most calls overlap the next one
LOOP = [*SMALL, "--train.steps=12", "--train.eval_every=4", "--checkpoint.every=6", "--checkpoint.keep=5"]


def run(run_dir, shakespeare, *extra):
    code, _, err = run_main(train_app.main, "--run_dir", str(run_dir), f"--data.cache_dir={shakespeare}", *LOOP,
                            *extra)
    assert code == 0, err[-2000:]


def saved_state(run_dir, step):
    """The checkpoint's whole train state (parameters, Adam moments, step, RNG key) as host arrays."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        return jax.device_get(checkpointer.restore(run_dir / "checkpoints" / str(step) / "state"))


def test_the_async_loop_dispatches_ahead_and_changes_nothing(tmp_path, shakespeare, monkeypatch):
    events = []
    next_batches, finish = RunContext.next_batches, TrainingLoop.finish
    monkeypatch.setattr(RunContext, "next_batches", lambda self, n: events.append("fetch") or next_batches(self, n))
    monkeypatch.setattr(TrainingLoop, "finish",
                        lambda self, c, **kw: events.append(f"read {c.step + c.n}") or finish(self, c, **kw))
    run(tmp_path / "async", shakespeare)
    # the batches of the call to step 2 are fetched (and that call dispatched) before step 2's metrics are read;
    # the calls ending at an evaluation (4, 8, 12) or a checkpoint (6) are waited for
    assert events[:4] == ["fetch", "fetch", "read 2", "read 4"]
    assert events.index("read 10") > events.index("fetch", events.index("read 8") + 1)

    run(tmp_path / "sync", shakespeare, "--train.async_calls=False")
    assert without_timing(read_jsonl(tmp_path / "async" / "metrics.jsonl")) == without_timing(
        read_jsonl(tmp_path / "sync" / "metrics.jsonl"))
    assert checkpoint_steps(tmp_path / "async") == checkpoint_steps(tmp_path / "sync") == [6, 12]
    for step in (6, 12):
        a, b = saved_state(tmp_path / "async", step), saved_state(tmp_path / "sync", step)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_call_that_returns_late_never_reads_faster_than_it_ran(tmp_path, shakespeare, monkeypatch):
    """A dispatch that returns only once its call is done, and 0.3 s later (XLA's GPU conditionals made every K-step
    call return at its last step): each call took at least 0.3 s of wall time, so no logged tokens/s may exceed a
    call's tokens over 0.3 s. (Timed from after its dispatch, such a call read as the moment between its return and
    its metrics: ~0 s.)"""
    import time

    from trainer.program.ahead import Ahead

    run_call = Ahead.__call__

    def returns_late(self, *args):
        out = jax.block_until_ready(run_call(self, *args))
        time.sleep(0.3)
        return out

    monkeypatch.setattr(Ahead, "__call__", returns_late)
    run(tmp_path, shakespeare)
    speeds = [r["tokens_per_s"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("tokens_per_s")]
    tokens_per_call = 2 * 8 * 32  # K steps of B × T (SMALL)
    assert len(speeds) >= 8 and max(speeds) <= tokens_per_call / 0.3
