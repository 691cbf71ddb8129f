"""Planning a TPU run from a machine without TPUs (`plan.py`): the real train call compiled for a topology
(aot.py, with compiles kept by compile_store.py), the compiled HLO read (hlo.py) and its step time predicted
(step_time.py, op_cost.py, collectives.py, step_report.py) from each chip's figures (chips.py), the search over a
preset's layouts (planner.py), and the calibration sweep and back-test behind the model (calibrate.py,
backtest.py). It imports the training library to build the program; training never imports it.
"""
