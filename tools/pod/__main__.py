"""`python -m tools.pod`: launch, delete, status (see tools/pod/__init__.py)."""

from __future__ import annotations

import sys

from errors import ConfigError, one_line_errors
from tools.pod.cli import ROOT, job_of, parser, print_plan, where
from tools.pod.job import Job
from tools.pod.keepalive import Keeper, delete_hint
from tools.pod.preflight import preflight
from tools.pod.shell import shell
from tools.pod.targets import delete_commands, state_command


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.verb == "delete":
        return max(shell(c).returncode for c in delete_commands(where(args)))
    if args.verb == "status":
        return shell(state_command(where(args))).returncode
    job = job_of(args)
    if args.dry_run:
        print_plan(job)
        return 0
    print(f"{job.slice.describe()}" + (f" x {job.num_slices} slices" if job.num_slices > 1 else ""), flush=True)
    # the tools, the code, the cluster, the zone: before the compile, before anything exists (--attach: the tools)
    job = preflight(job, ROOT, tools_only=args.attach)
    if not args.skip_aot and not args.attach and job.slice.is_tpu:
        check_fits(job)
    return keep(job, attach=args.attach)


def check_fits(job: Job) -> None:
    """Compiles the train call for the topology (`v5e:16x16*2` for 2 slices) and refuses a program that does not
    fit."""
    from tools.pod.cli import check_batch
    from planning.aot import compile_for_topology

    cfg = check_batch(job.train_args, job.num_slices)
    report = compile_for_topology(cfg, job.aot_topology)  # raises DoesNotFit in one line
    print(report.text(), flush=True)
    if not report.fits:
        raise ConfigError(f"--topology {job.slice.name}: the train call needs {report.total_bytes / 2**30:.2f} GiB"
                          f" per chip of {report.hbm_bytes / 2**30:.0f} GiB; shard more (mesh.fsdp), shrink"
                          " train.batch_size or set model.remat (--skip_aot to launch anyway)")


def keep(job: Job, attach: bool = False) -> int:
    keeper = Keeper(job)
    keeper.write_files()
    try:
        if not attach:
            if (failed := keeper.launch()) != 0:
                return failed
            if job.where.target == "tpu-vm":
                print(f"{job.name}: training on every host, detached from this launcher: stopping it (Ctrl-C, a"
                      f" closed laptop) leaves it running. Each host's output: {job.run_dir}/logs/console.*.log",
                      flush=True)
        return keeper.follow()
    except KeyboardInterrupt:
        print(f"\nstopped polling {job.name}; it keeps running. State: python -m tools.pod status"
              f" {delete_hint(job).split(' delete ', 1)[1]}; delete it: {delete_hint(job)}; poll it again:"
              " the same launch command with --attach", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
