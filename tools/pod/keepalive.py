"""Bringing a job up and keeping it alive: create, wait until ready, install, start; then poll. When the slice is
preempted or the training fails, recreate what is gone and start the same command again, `--retries` times;
train.py resumes from the newest complete checkpoint. Each relaunch is a `relaunch` record in the run's
events.jsonl (the goodput report counts the time from the last record before it to the new attempt's start as
`restart_gap`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from errors import UserError
from tools.pod.job import Job
from tools.pod.targets import DONE, GONE, PENDING, RUNNING, delete_commands, plan, state_command, state_of


class CommandFailed(UserError):
    pass


def shell(command: str, *, capture: bool = False) -> subprocess.CompletedProcess:
    """Runs one of the plan's commands as printed (bash), echoing it first."""
    print(f"$ {command}", flush=True)
    return subprocess.run(["bash", "-c", command], capture_output=capture, text=True, check=False)


def must(command: str) -> None:
    r = shell(command)
    if r.returncode != 0:
        raise CommandFailed(f"`{command.split(' --command=')[0][:200]}` failed with status {r.returncode}")


def state(job: Job) -> str:
    r = subprocess.run(["bash", "-c", state_command(job.where)], capture_output=True, text=True, check=False)
    return state_of(job.where.target, r.returncode, r.stdout)


class Keeper:
    """One job's life under the launcher."""

    def __init__(self, job: Job):
        self.job, self.plan = job, plan(job)
        self.procs: list[subprocess.Popen] = []
        self.relaunches = 0

    def write_files(self) -> None:
        self.job.workdir.mkdir(parents=True, exist_ok=True)
        for name, text in self.plan.files.items():
            (self.job.workdir / name).write_text(text)

    def bring_up(self, *, create: bool = True) -> None:
        if create:
            for command in self.plan.create:
                must(command)
        if self.plan.ready is not None:
            self._wait_ready()
        for command in self.plan.install:
            must(command)
        self.start()

    def _wait_ready(self) -> None:
        print(f"waiting for {self.job.name} to be ACTIVE", flush=True)
        while (s := state(self.job)) != RUNNING:
            if s == GONE:
                raise CommandFailed(f"{self.job.name} went away before it was ready")
            time.sleep(self.job.poll_seconds)

    def start(self) -> None:
        """Starts the training: long-lived ssh sessions (tpu-vm, in their own session so a Ctrl-C here leaves
        them running; output to a log this process follows) or a submission that returns."""
        log = self.job.workdir / f"attempt-{self.relaunches + 1}.log"
        self.procs = []
        for command in self.plan.start:
            if self.job.where.target == "tpu-vm":
                print(f"$ {command}\n(output: {log})", flush=True)
                with open(log, "a") as out:  # the session keeps its own copy of the file
                    self.procs.append(subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, start_new_session=True))
                threading.Thread(target=_follow, args=(log, self.procs[-1]), daemon=True).start()
            else:
                must(command)

    def follow(self) -> int:
        """Polls until the run finishes (0) or the relaunches run out (1)."""
        while True:
            time.sleep(self.job.poll_seconds)
            outcome = self._outcome()
            if outcome == DONE:
                print(f"{self.job.name}: the run finished; delete what it used with: {delete_hint(self.job)}")
                return 0
            if outcome in (RUNNING, PENDING):
                continue
            if self.relaunches >= self.job.retries:
                print(f"error: {self.job.name}: {outcome} and no relaunch left (--retries {self.job.retries})",
                      file=sys.stderr, flush=True)
                return 1
            self.relaunch(outcome)

    def _outcome(self) -> str:
        """running / pending / done, or why it must be relaunched: gone (the slice or workload is), failed."""
        s = state(self.job)
        if self.job.where.target != "tpu-vm" or s != RUNNING:
            return s if s != DONE or run_finished(self.job.run_dir) is not False else "failed"
        if not self.procs:  # attached to a launch made earlier: the run's own records tell
            return {True: DONE, False: "failed", None: RUNNING}[run_ended(self.job.run_dir)]
        if any(p.poll() is None for p in self.procs):
            return RUNNING
        ok = all(p.returncode == 0 for p in self.procs) and run_finished(self.job.run_dir) is not False
        return DONE if ok else "failed"  # exit 0 after a SIGTERM (preempted, saved) is no finished run

    def relaunch(self, why: str) -> None:
        self.relaunches += 1
        for p in self.procs:  # what is left of the last attempt's sessions
            if p.poll() is None:
                p.kill()
        reason = {GONE: "the slice or workload is gone (preempted or deleted)"}.get(why, "the training failed")
        print(f"{self.job.name}: {reason}; relaunch {self.relaunches} of {self.job.retries}", flush=True)
        record_relaunch(self.job.run_dir, self.relaunches, reason)
        recreate = why == GONE or self.job.where.target != "tpu-vm"
        if recreate:
            for command in delete_commands(self.job.where):
                shell(command)  # a preempted queued resource must be deleted before its name is free again
        self.bring_up(create=recreate)


def _follow(log: Path, proc: subprocess.Popen) -> None:
    """Copies the ssh sessions' output to the console as it arrives."""
    with open(log) as f:
        while True:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            elif proc.poll() is not None:
                return
            else:
                time.sleep(0.2)


def run_finished(run_dir: str) -> bool | None:
    """Whether the run's last attempt ended "finished" (None: its events cannot be read from here)."""
    try:
        from trainer.storage.run_dir import RunDir

        records = RunDir(run_dir).read_events(say_torn=False)
    except Exception:  # noqa: BLE001 - no gcs extra here, no credentials: the exit status decides alone
        return None
    ends = [r for r in records if r.get("event") == "attempt_end"]
    return bool(ends) and ends[-1].get("how") == "finished"


def run_ended(run_dir: str) -> bool | None:
    """Whether the newest attempt ended finished (True) or otherwise (False); None while it runs (or it crashed
    without a record: an attached launcher then waits for the slice's state to change)."""
    try:
        from trainer.storage.run_dir import RunDir

        records = [r for r in RunDir(run_dir).read_events(say_torn=False) if r.get("event") != "relaunch"]
    except Exception:  # noqa: BLE001
        return None
    if not records or records[-1].get("event") != "attempt_end":
        return None
    return records[-1].get("how") == "finished"


def record_relaunch(run_dir: str, number: int, reason: str) -> None:
    """Appends the relaunch to events.jsonl (after the last attempt has ended: one writer at a time)."""
    try:
        from trainer.storage.files import absolute, append

        append(absolute(run_dir) / "events.jsonl",
               json.dumps({"event": "relaunch", "time": time.time(), "number": number, "reason": reason}) + "\n")
    except Exception as e:  # noqa: BLE001 - the relaunch matters more than its record
        print(f"warning: could not record the relaunch in {run_dir}/events.jsonl ({e})", file=sys.stderr)


def delete_hint(job: Job) -> str:
    w = job.where
    flags = f"--target {w.target} --name {w.name}" + "".join(
        f" --{k} {v}" for k, v in (("zone", w.zone), ("project", w.project), ("cluster", w.cluster)) if v)
    return f"python -m tools.pod delete {flags}"
