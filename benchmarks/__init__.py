"""Measurements of the train step, the host loop, corpus preparation, μP's transfer and more; each module is a
program (`python -m benchmarks.NAME --help`), its results in the docs page of what it measures.

Importing the package sets libtpu's environment as train.py, eval.py and plan.py do before JAX starts its backends
(trainer/libtpu_env.py): on a machine without a TPU, libtpu's three false errors stay off the benchmarks' output."""

from trainer import libtpu_env

libtpu_env.configure()
