"""Bringing a job up and following it to its end: create, wait until ready, install, start; then poll the job's
state every --poll_seconds. Where the launcher owns relaunching (tpu-vm, slurm: targets.Plan.relaunches), a
preempted slice or a failed training is started again, `--retries` times (a gone slice deleted and created
first); train.py resumes from the newest complete checkpoint. Each relaunch is a `relaunch` record in the run's
events.jsonl (the goodput report counts the time from the last record before it to the new attempt's start as
`restart_gap`). A state command that fails (an API or network error) says nothing about the job: it is polled
again, never taken for a lost slice.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from errors import UserError
from tools.pod.job import Job
from tools.pod.targets import (DONE, FAILED, GONE, PENDING, RUNNING, UNKNOWN, delete_commands, job_state_command,
                               job_state_of, plan, state_command, state_of)

WHY = {GONE: "the slice or job is gone (preempted or deleted)", FAILED: "the training failed"}


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


def quietly(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)


def state(job: Job) -> str:
    """The job's state: its resource's, and on a running TPU VM slice its training's (process 0's host)."""
    r = quietly(state_command(job.where))
    s = state_of(job.where.target, r.returncode, r.stdout, r.stderr)
    if job.where.target == "tpu-vm" and s == RUNNING:
        r = quietly(job_state_command(job))
        s = job_state_of(r.returncode, r.stdout)
    if s == DONE and run_finished(job.run_dir) is False:
        return FAILED  # exit 0 after a SIGTERM (preempted, saved) is no finished run
    return s


class Keeper:
    """One job's life under the launcher."""

    def __init__(self, job: Job):
        self.job, self.plan = job, plan(job)
        self.relaunches, self.unknown_since = 0, None

    def write_files(self) -> None:
        self.job.workdir.mkdir(parents=True, exist_ok=True)
        for name, text in self.plan.files.items():
            (self.job.workdir / name).write_text(text)

    def bring_up(self, *, create: bool = True) -> None:
        if create:
            for command in self.plan.create:
                must(command)
        if self.plan.ready:
            self._wait_ready()
        for command in self.plan.install:
            must(command)
        for command in self.plan.start:
            must(command)

    def _wait_ready(self) -> None:
        print(f"waiting for {self.job.name} to be ACTIVE", flush=True)
        while True:
            r = quietly(state_command(self.job.where))
            s = state_of(self.job.where.target, r.returncode, r.stdout, r.stderr)
            if s == RUNNING:
                return
            if s == GONE:
                raise CommandFailed(f"{self.job.name} went away before it was ready ({r.stdout.strip() or 'deleted'})")
            time.sleep(self.job.poll_seconds)

    def follow(self) -> int:
        """Polls until the run finishes (0), or fails with no relaunch left or none of the launcher's (1)."""
        while True:
            time.sleep(self.job.poll_seconds)
            outcome = self.outcome()
            if outcome == DONE:
                print(f"{self.job.name}: the run finished; delete what it used with: {delete_hint(self.job)}")
                return 0
            if outcome in (RUNNING, PENDING, UNKNOWN):
                continue
            if not self.plan.relaunches:
                return self._ended(outcome)
            if self.relaunches >= self.job.retries:
                print(f"error: {self.job.name}: {WHY[outcome]} and no relaunch left (--retries {self.job.retries})",
                      file=sys.stderr, flush=True)
                return 1
            self.relaunch(outcome)

    def outcome(self) -> str:
        s = state(self.job)
        if s == UNKNOWN and self.unknown_since is None:
            self.unknown_since = time.time()
            print(f"{self.job.name}: its state could not be read (the next poll asks again)", flush=True)
        elif s != UNKNOWN and self.unknown_since is not None:
            print(f"{self.job.name}: its state reads again after {time.time() - self.unknown_since:.0f} s", flush=True)
            self.unknown_since = None
        return s

    def _ended(self, outcome: str) -> int:
        """JobSet's end (it restarts the job itself, up to --retries times): said, not relaunched."""
        what = {GONE: "the JobSet is gone (deleted outside the launcher)",
                FAILED: f"the JobSet failed after its restarts (maxRestarts {self.job.retries}), or completed"
                        " before the run finished"}[outcome]
        print(f"error: {self.job.name}: {what}; the same launch command resumes the run from its newest"
              " checkpoint", file=sys.stderr, flush=True)
        return 1

    def relaunch(self, why: str) -> None:
        self.relaunches += 1
        print(f"{self.job.name}: {WHY[why]}; relaunch {self.relaunches} of {self.job.retries}", flush=True)
        record_relaunch(self.job.run_dir, self.relaunches, WHY[why])
        recreate = why == GONE or not self.plan.stop
        for command in delete_commands(self.job.where) if recreate else self.plan.stop:
            shell(command)  # a preempted queued resource must be deleted before its name is free again
        self.bring_up(create=recreate)


def run_finished(run_dir: str) -> bool | None:
    """Whether the run's last attempt ended "finished" (None: its events cannot be read from here)."""
    try:
        from trainer.storage.run_dir import RunDir

        records = RunDir(run_dir).read_events(say_torn=False)
    except Exception:  # noqa: BLE001 - no gcs extra here, no credentials: the exit status decides alone
        return None
    ends = [r for r in records if r.get("event") == "attempt_end"]
    return bool(ends) and ends[-1].get("how") == "finished"


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
    workdir = str(w.workdir) if w.target == "slurm" else ""  # where the job's id is
    flags = f"--target {w.target} --name {w.name}" + "".join(
        f" --{k} {v}" for k, v in (("zone", w.zone), ("project", w.project), ("cluster", w.cluster),
                                   ("workdir", workdir)) if v)
    return f"python -m tools.pod delete {flags}"
