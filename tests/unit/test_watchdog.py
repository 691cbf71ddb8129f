"""The stall watchdog in-process (its ending recorded instead of exiting): the timeout rule, what it writes,
what keeps it quiet. tests/e2e/test_multiprocess.py stalls real 2-process jobs."""

import threading
import time

import jax
import pytest

from trainer.run.watchdog import COMPILING, Watchdog, stall_timeout


def test_the_automatic_timeout_is_a_multiple_of_the_median_call_with_a_floor():
    assert stall_timeout([], floor=300) == 300  # no call timed yet
    assert stall_timeout([1.0, 2.0, 100.0], floor=300) == 300
    assert stall_timeout([1.0, 2.0, 100.0], floor=1) == 40  # 20 × the median: one slow call moves nothing
    assert stall_timeout([1.0, 2.0, 100.0], floor=1, factor=5) == 10


class Recorded:
    """An ending that records its reason and when it came."""

    def __init__(self):
        self.reason, self.at, self.done = None, None, threading.Event()

    def __call__(self, reason):
        self.reason, self.at = reason, time.monotonic()
        self.done.set()


def a_stuck_read(done: threading.Event) -> None:
    done.wait(10)  # the main thread's frame the stacks must show


def test_a_stall_writes_every_threads_stack_and_ends_with_one_line(tmp_path):
    stacks, ended = tmp_path / "logs" / "stacks.0.txt", Recorded()
    with Watchdog(stacks, timeout=0.3, floor=300, end=ended) as dog:
        beaten = time.monotonic()  # before the beat: the stall is counted from it
        dog.beat()
        reader = threading.Thread(target=a_stuck_read, args=(ended.done,), name="reader")
        reader.start()
        a_stuck_read(ended.done)
        reader.join()
    assert 0.3 <= ended.at - beaten < 5
    assert ended.reason == ("stalled: no train call finished for 0 s (--distributed.stall_timeout_seconds: 0.3 s);"
                            f" every thread's stack is in {stacks}")
    text = stacks.read_text()
    assert text.splitlines()[0].endswith(ended.reason)
    assert text.count("in a_stuck_read") == 2  # this thread's and the reader's: all threads
    assert "in _stalled" in text  # the watchdog's own


def test_the_automatic_timeout_waits_for_twenty_median_calls(tmp_path):
    ended = Recorded()
    with Watchdog(tmp_path / "stacks.txt", timeout=None, floor=0.1, processes=2, process=1, end=ended) as dog:
        dog.beat()  # the first call: compiled, not timed
        for _ in range(3):
            beaten = time.monotonic()
            dog.beat(0.05)  # three calls of 50 ms: the timeout is 20 × 0.05 = 1 s, past the 0.1 s floor
        assert ended.done.wait(10)
    assert 1.0 <= ended.at - beaten < 6
    assert ("no train call finished on process 1 for 1 s (--distributed.stall_timeout_seconds: 1 s, automatic)"
            in ended.reason)


def test_a_compilation_restarts_the_clock(tmp_path):
    """A compile mid-run (the pre-save probe's, the first evaluation's) is progress, as JAX reports it."""
    ended = Recorded()
    with Watchdog(tmp_path / "stacks.txt", timeout=1.5, floor=300, end=ended) as dog:
        dog.beat()
        time.sleep(1.0)
        jax.monitoring.record_event_duration_secs(COMPILING[-1], 1.0)  # as a compile ending now
        time.sleep(1.0)
        assert not ended.done.is_set()  # 2 s since the beat, 1 s since the compile
        assert ended.done.wait(10)


def test_beats_and_pauses_keep_it_quiet_and_no_stall_leaves_no_file(tmp_path):
    stacks, ended = tmp_path / "stacks.txt", Recorded()
    with Watchdog(stacks, timeout=0.5, floor=300, end=ended) as dog:
        for _ in range(8):
            dog.beat(0.01)
            time.sleep(0.1)
        with dog.paused():
            time.sleep(1.0)  # an lm-eval run: longer than the timeout
        assert stacks.exists()  # open while armed: faulthandler's backstop writes to it
    assert not ended.done.is_set() and not stacks.exists()


def test_zero_turns_it_off(tmp_path):
    ended = Recorded()
    with Watchdog(tmp_path / "stacks.txt", timeout=0, floor=300, end=ended) as dog:
        dog.beat()
        assert not dog.thread.is_alive()
    assert not (tmp_path / "stacks.txt").exists()


def test_a_peers_stall_writes_this_processes_stacks_too(tmp_path):
    stacks = tmp_path / "stacks.1.txt"
    with Watchdog(stacks, timeout=60, floor=300, end=Recorded()) as dog:
        dog.beat()
        assert dog.note("cannot write /x/loss.png: Read-only file system") == ""  # not a stall: no stacks
        note = dog.note("stalled: no train call finished on process 0 for 9 s (...)")
        assert note == f"; its threads' stacks are in {stacks}"
        text = stacks.read_text()
    assert text.splitlines()[0].endswith("ended by another process: stalled: no train call finished on process 0"
                                         " for 9 s (...)")
    assert "in test_a_peers_stall_writes_this_processes_stacks_too" in text


def test_zero_is_a_valid_setting_and_a_zero_floor_is_not():
    """(NaN, infinite and negative values of both: tests/unit/test_config.py's sweep of every numeric field.)"""
    import dataclasses

    from configs.base import Config, DistributedConfig
    from errors import ConfigError

    assert Config(distributed=DistributedConfig(stall_timeout_seconds=0)).distributed.stall_timeout_seconds == 0
    with pytest.raises(ConfigError, match=r"^--distributed.stall_floor_seconds must be a finite number > 0, got 0"):
        Config(distributed=dataclasses.replace(DistributedConfig(), stall_floor_seconds=0))
