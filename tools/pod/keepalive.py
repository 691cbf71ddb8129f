"""Bringing a job up and following it to its end: create, wait until ready, install, start; then poll the job's
state every --poll_seconds. Where the launcher owns relaunching (tpu-vm, slurm: targets.Plan.relaunches), a
preempted slice, a saved preemption or a failed training is started again, `--retries` times in all (a gone slice
deleted and created first); train.py resumes from the newest complete checkpoint. Each relaunch is a `relaunch`
record in the run's events.jsonl (the goodput report counts the time from the last record before it to the new
attempt's start as `restart_gap`). A relaunch that fails (a package index down for all its tries, no capacity)
is one more failed attempt, not the launcher's end.

A state command that fails (an API or network error) says nothing about the job: it is polled again, never taken
for a lost slice; but the launcher does not go blind quietly: an answer that only a person can fix (gcloud
logged out or asking to re-authenticate, a missing command) ends it after two polls, any other after
--blind_seconds, each in one line. Every way the launcher ends on a failure is one line that names it and
prints the delete command (or, with --delete_on_failure, runs it).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from tools.pod.host import attempt_end
from tools.pod.job import Job
from tools.pod.shell import StepFailed, must, quietly, shell
from tools.pod.targets import (DONE, FAILED, GONE, PENDING, PREEMPTED, RUNNING, UNKNOWN, delete_commands,
                               job_state_command, job_state_of, plan, state_command, state_of)

WHY = {GONE: "the slice or job is gone (preempted or deleted)", FAILED: "the training failed",
       PREEMPTED: "the training was preempted and saved its checkpoint"}
LEFT = {"tpu-vm": "the slice (queued resource) {} is still up, and billed", "xpk": "the workload {} may exist",
        "jobset": "the JobSet {} may exist", "slurm": "the job may still be queued"}
# What only a person can fix (gcloud's credentials/exceptions.py and store.py messages; kubectl's; a shell's).
# "There was a problem refreshing your current auth tokens: <a network error>" is not among them: transient.
NEEDS_A_PERSON = ("You do not currently have an active account selected", "does not have any valid credentials",
                  "Reauthentication", "reauthenticating", "invalid_grant", "command not found",
                  "You must be logged in to the server")
REMIND_S = 600.0  # an unreadable state is said again this often


@dataclasses.dataclass(frozen=True)
class Reading:
    state: str
    cause: str = ""  # UNKNOWN: the state command's first line of complaint
    needs_a_person: bool = False


def read_state(job: Job, *, resource_only: bool = False) -> Reading:
    """The job's state: its resource's, and on a running TPU VM slice its training's (process 0's host; not
    `resource_only`, as while the slice is made ready)."""
    r = quietly(state_command(job.where))
    s = state_of(job.where.target, r.returncode, r.stdout, r.stderr)
    if job.where.target == "tpu-vm" and s == RUNNING and not resource_only:
        r = quietly(job_state_command(job))
        s = job_state_of(r.returncode, r.stdout)
    if s == DONE and attempt_end(job.run_dir, 0) == "preempted":
        return Reading(PREEMPTED)  # train.py's exit 0 after a saved SIGTERM, read where the run directory reads
    if s != UNKNOWN:
        return Reading(s)
    said = "\n".join((r.stderr, r.stdout)).strip()
    cause = next((line.strip() for line in said.splitlines() if line.strip()), f"exit status {r.returncode}")
    return Reading(UNKNOWN, cause, r.returncode == 127 or any(p in said for p in NEEDS_A_PERSON))


class Keeper:
    """One job's life under the launcher."""

    def __init__(self, job: Job):
        self.job, self.plan = job, plan(job)
        self.relaunches, self.unknown_since, self.reminded, self.logged_out = 0, None, 0.0, 0

    def write_files(self) -> None:
        self.job.workdir.mkdir(parents=True, exist_ok=True)
        for name, text in self.plan.files.items():
            (self.job.workdir / name).write_text(text)

    def launch(self) -> int:
        """Brings the job up; a step that fails for good ends the launch in one line (0: up and started)."""
        try:
            self.bring_up()
        except StepFailed as e:
            return self.give_up(str(e))
        return 0

    def bring_up(self, *, create: bool = True) -> None:
        """Creation and submission run once (a repeated one could make a second job); the install and the start
        on the hosts, which may run again, up to --tries times."""
        j = self.job
        if create:
            for command in self.plan.create:
                must(command, f"`{_head(command)}`")
        if self.plan.ready:
            self._wait_ready()
        for command in self.plan.install:
            must(command, "the install on the hosts", tries=j.tries, backoff_seconds=j.backoff_seconds)
        for command in self.plan.start:  # tpu-vm's detached start may run again; a submission may not
            if self.plan.stop:
                must(command, "the start on the hosts", tries=j.tries, backoff_seconds=j.backoff_seconds)
            else:
                must(command, f"the submission (`{_head(command)}`)")

    def _wait_ready(self) -> None:
        print(f"waiting for {self.job.name} to be ACTIVE", flush=True)
        while True:
            reading = read_state(self.job, resource_only=True)
            if reading.state == RUNNING:
                return
            if reading.state == GONE:
                raise StepFailed(f"{self.job.name} went away before it was ready (preempted, failed or deleted)")
            if reading.state == UNKNOWN and (ended := self._blind(reading)) is not None:
                raise StepFailed(ended)
            time.sleep(self.job.poll_seconds)

    def follow(self) -> int:
        """Polls until the run finishes (0), or fails with no relaunch left or none of the launcher's (1)."""
        while True:
            time.sleep(self.job.poll_seconds)
            reading = read_state(self.job)
            if reading.state == UNKNOWN:
                if (ended := self._blind(reading)) is not None:
                    return self.give_up(ended, unwatched=True)
                continue
            self._sees_again()
            if reading.state == DONE:
                print(f"{self.job.name}: the run finished; delete what it used with: {delete_hint(self.job)}")
                return 0
            if reading.state in (RUNNING, PENDING):
                continue
            if not self.plan.relaunches:
                return self._ended(reading.state)
            if self.relaunches >= self.job.retries:
                return self.give_up(f"{WHY[reading.state]} and no relaunch is left (--retries {self.job.retries})")
            self.relaunch(reading.state)

    def _blind(self, reading: Reading) -> str | None:
        """An unreadable state: said once with its cause, again every REMIND_S; the reason to stop watching when
        only a person can fix it (two polls in a row) or it has lasted --blind_seconds; else None."""
        now = time.time()
        self.logged_out = self.logged_out + 1 if reading.needs_a_person else 0
        if self.unknown_since is None:
            self.unknown_since, self.reminded = now, now
            print(f"{self.job.name}: its state could not be read ({reading.cause}); the next poll asks again",
                  flush=True)
        elif now - self.reminded >= REMIND_S:
            self.reminded = now
            print(f"{self.job.name}: its state still cannot be read after {now - self.unknown_since:.0f} s"
                  f" ({reading.cause})", flush=True)
        if self.logged_out >= 2:
            return f"its state cannot be read: {reading.cause} (log in again, e.g. gcloud auth login)"
        if now - self.unknown_since >= self.job.blind_seconds:
            return (f"its state could not be read for {now - self.unknown_since:.0f} s (--blind_seconds;"
                    f" {reading.cause})")
        return None

    def _sees_again(self) -> None:
        if self.unknown_since is not None:
            print(f"{self.job.name}: its state reads again after {time.time() - self.unknown_since:.0f} s",
                  flush=True)
            self.unknown_since, self.logged_out = None, 0

    def _ended(self, outcome: str) -> int:
        """JobSet's end (it restarts the job itself, up to --retries times): said, not relaunched."""
        what = {GONE: "the JobSet is gone (deleted outside the launcher)",
                FAILED: f"the JobSet failed after its restarts (maxRestarts {self.job.retries}), or completed"
                        " before the run finished",
                PREEMPTED: "the JobSet completed, but its run was preempted (saved), not finished: its pods"
                           " exited 0 instead of 42"}[outcome]
        return self.give_up(f"{what}; the same launch command resumes the run from its newest checkpoint")

    def relaunch(self, why: str) -> None:
        """Starts the job again; a relaunch that fails is one more failed attempt, which the next poll sees."""
        self.relaunches += 1
        print(f"{self.job.name}: {WHY[why]}; relaunch {self.relaunches} of {self.job.retries}", flush=True)
        record_relaunch(self.job.run_dir, self.relaunches, WHY[why])
        recreate = why == GONE or not self.plan.stop
        for command in delete_commands(self.job.where) if recreate else self.plan.stop:
            shell(command)  # a preempted queued resource must be deleted before its name is free again
        try:
            self.bring_up(create=recreate)
        except StepFailed as e:
            print(f"warning: {self.job.name}: relaunch {self.relaunches} failed: {e}; the next poll decides",
                  file=sys.stderr, flush=True)

    def give_up(self, what: str, *, unwatched: bool = False) -> int:
        """The launcher's end on a failure: one line naming it, what is left running and how to delete it (or,
        with --delete_on_failure, its deletion's outcome). 1."""
        j, hint = self.job, delete_hint(self.job)
        left = LEFT[j.where.target].format(j.name)
        if unwatched:
            left = (f"{left}, unwatched and never relaunched; follow it again with the same launch command and"
                    " --attach")
        if j.delete_on_failure:
            failed = [c for c in delete_commands(j.where) if shell(c).returncode != 0]
            then = f"deleting it failed too: {hint}" if failed else "deleted it (--delete_on_failure)"
        else:
            then = f"delete it with: {hint}"
        print(f"error: {j.name}: {what}; {left}; {then}", file=sys.stderr, flush=True)
        return 1


def _head(command: str) -> str:
    """A command's name for a message: the words before its flags (`gcloud compute tpus queued-resources create
    NAME`, `sbatch` of `id=$(sbatch --parsable ...)`)."""
    words = command.split(" --", 1)[0].split("$(")[-1].split()
    return " ".join(w for w in words if "=" not in w)[:120]


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
