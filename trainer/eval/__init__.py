"""Evaluation runs (`eval.py`): the driver, text samples, and lm-evaluation-harness tasks."""
