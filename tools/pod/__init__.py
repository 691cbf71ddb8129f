"""Launch training on a TPU pod (queued resources, xpk, a GKE JobSet) or a Slurm GPU cluster, and keep it alive.

    python -m tools.pod launch --topology v5e-256 --zone us-west4-a --project my-project \
        --run_dir gs://my-bucket/runs/gpt2_xl --retries 10 -- --config gpt2_xl_pod --data.dataset=/data/fineweb
    python -m tools.pod status --name gpt2-v5e-256 --zone us-west4-a --project my-project
    python -m tools.pod delete --name gpt2-v5e-256 --zone us-west4-a --project my-project

`launch` checks the tools, the code the hosts fetch and where the job goes (tools/pod/preflight.py), compiles the
train call for the topology (planning/aot.py) and refuses one that does not fit, before anything is created;
`--dry_run` prints every check, command and file instead of running them. docs/pods.md has the walk-through.
"""
