"""Where a run's time went: the goodput report of any run directory, at any time.

    python -m tools.goodput runs/shakespeare_cpu            # local or gs://
    python -m tools.goodput runs/shakespeare_cpu --json     # the figures as one JSON object
"""

from __future__ import annotations

import argparse
import json
import sys

from errors import StorageError, one_line_errors
from trainer.telemetry.goodput import read_events, report
from trainer.telemetry.timeline import EVENTS


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.goodput", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (local or gs://)")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON object")
    args = parser.parse_args(argv)
    result = report(read_events(args.run_dir))
    if not result.attempts:
        raise StorageError(f"{args.run_dir}: no {EVENTS} (a run directory written by train.py records one)")
    print(json.dumps({**result.summary(), "attempts": result.attempts}) if args.json else result.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
