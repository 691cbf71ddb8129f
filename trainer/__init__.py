"""The training library: `train.py` and `eval.py` parse a config and call into it (planning/ builds on it).

    run/        a training run: the driver (start-up order), the shared context, the loop and its observers,
                resume, rollback, preemption, --init_from, the data position, the stall watchdog
    program/    what gets jitted: the train program (K steps in a scan), the evaluator, the optimizer, the spike
                guard, the model's layout on a mesh, the mesh
    storage/    files local or on gs://: paths and appends, retries, the run directory's lock and files,
                Orbax checkpoints, the compile cache
    telemetry/  metrics and wandb, the events timeline, the goodput report, library logs, the profiler
    eval/       evaluation runs: the driver, sampling, lm-evaluation-harness tasks
    hardware.py peak FLOP/s; processes.py the job's processes and their agreements;
    corpus.py   which corpus a run reads; malloc.py glibc tuning
"""
