"""TPU programs compiled from a machine without TPUs: `--aot` (aot.py), the HLO reader (hlo.py), the predicted step
time (step_time.py) and `--plan` (planner.py)."""
