"""GPT-2 XL (1.5B) on a TPU v5e-256 pod (64 hosts × 4 chips) with FSDP: gpt2_medium's run, larger.

Sizing, as `python plan.py --config gpt2_xl_pod --topology v5e:16x16 --search` chose it (docs/aot_planning.md,
"Chosen, and why"): 1M tokens per step (1024 × 1024, GPT-3's batch for this size), 4 sequences per chip. FSDP shards
the 1.5B float32 parameters and AdamW moments (~19 GB) 64 ways (~0.3 GB per chip); 64, not 256, because FSDP splits
the width (1600 = 64 × 25 cannot split 256 ways), and the remaining factor 4 is plain data parallelism. remat="dots"
keeps each block's matmul outputs and q, k, v as the attention reads them (gpt2/config.py QKV) and recomputes only
the elementwise rest; no remat needs 28.9 GiB. Layers unrolled and one step per call: the compiler schedules FSDP's
all-gathers across layer boundaries. `python plan.py --config gpt2_xl_pod --topology v5e:16x16` predicts 356.1 ms
per step, MFU 60.0 % (57.3 % counting causal attention only), 10.22 GiB per chip, with the libtpu flags train.py
sets on a v5e (trainer/libtpu_env.py); 96 ms of the step are collectives the schedule leaves exposed, 64 ms of them the
synchronous all-reduces over fsdp. The back-test has no comparable measured run for a program this small per chip
with that much exposed communication (docs/aot_planning.md, "Chosen, and why").
"""

from configs import extend
from configs.gpt2_medium import CONFIG as GPT2_MEDIUM

CONFIG = extend(
    GPT2_MEDIUM,
    run_dir="runs/gpt2_xl",  # on a pod: storage every host sees: gs://bucket/path (docs/pods.md) or an NFS mount
    model=dict(n_layer=48, n_head=25, n_embd=1600, remat="dots", scan_layers=False),
    data=dict(dataset="/data/fineweb", num_workers=8),
    optim=dict(lr=2e-4),
    schedule=dict(warmup_steps=1000),
    train=dict(steps=30_000, batch_size=1024, grad_accum=1, steps_per_call=1, eval_every=1000, eval_batches=20),
    mesh=dict(data=4),  # fsdp over the rest, as gpt2_medium
    checkpoint=dict(every=500, keep=2),
)
