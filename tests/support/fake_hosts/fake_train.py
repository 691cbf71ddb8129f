"""train.py's stand-in for the launcher's fast tests (tests/e2e/test_pod.py), on single-host slices: an attempt that
waits while <run_dir>/hold exists, then ends with the status in <run_dir>/exit (taken: the next attempt finds none,
and exits 0), recorded in <run_dir>/events.jsonl as train.py records an attempt."""

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
code = int((run / "exit").read_text()) if (run / "exit").exists() else 0
(run / "exit").unlink(missing_ok=True)
with open(events, "a") as f:
    how = "finished" if code == 0 else "failed"
    f.write(json.dumps({"event": "attempt_end", "attempt": attempt, "time": time.time(), "how": how}) + "\n")
print(f"attempt {attempt}: {how}", flush=True)
sys.exit(code)
