"""train.py's stand-in for the launcher's fast tests (tests/e2e/test_pod*.py), on single-host slices: an attempt that
waits while <run_dir>/hold exists, then ends as train.py ends one: with the status in <run_dir>/exit (taken: the
next attempt finds none, and exits 0), or, when <run_dir>/preempt exists (taken too), as a saved preemption (its
`attempt_end` record says "preempted", its status 0, as trainer/run/driver.py ends one today). Each attempt is
recorded in <run_dir>/events.jsonl as train.py records it."""

import json
import sys
import time
from pathlib import Path

run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--run_dir=")))
run.mkdir(parents=True, exist_ok=True)
events = run / "events.jsonl"
attempt = sum(1 for line in events.read_text().splitlines() if '"attempt_start"' in line) + 1 if events.exists() else 1
with open(events, "a") as f:
    f.write(json.dumps({"event": "attempt_start", "attempt": attempt, "time": time.time()}) + "\n")
while (run / "hold").exists():
    time.sleep(0.05)
preempted = (run / "preempt").exists()
code = int((run / "exit").read_text()) if (run / "exit").exists() and not preempted else 0
(run / ("preempt" if preempted else "exit")).unlink(missing_ok=True)
how = "preempted" if preempted else "finished" if code == 0 else "failed"
with open(events, "a") as f:
    f.write(json.dumps({"event": "attempt_end", "attempt": attempt, "time": time.time(), "how": how}) + "\n")
print(f"attempt {attempt}: {how}", flush=True)
sys.exit(code)
