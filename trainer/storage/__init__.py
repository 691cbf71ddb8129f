"""Storage, local or `gs://`: files.py, retries.py and lock.py need no JAX; run_dir.py owns the run directory's
files, checkpoints.py Orbax's `checkpoints/`, compile_cache.py JAX's persistent cache."""
