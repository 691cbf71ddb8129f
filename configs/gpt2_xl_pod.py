"""GPT-2 XL (1.5B) on a TPU v5e-256 pod (64 hosts × 4 chips) with FSDP.

Sizing, as `python train.py --config gpt2_xl_pod --plan v5e:16x16` chose it (docs/aot_planning.md, "Chosen,
and why"): 1M tokens per step (1024 × 1024, GPT-3's batch for this size), 4 sequences per chip. FSDP shards
the 1.5B float32 parameters and AdamW moments (~19 GB) 64 ways (~0.3 GB per chip); 64, not 256, because FSDP
splits the width (1600 = 64 × 25 cannot split 256 ways), and the remaining factor 4 is plain data parallelism.
remat="dots" keeps each block's matmul outputs (10.3 GiB per chip of the 16 GiB HBM) and recomputes only the
elementwise rest; no remat needs 28.9 GiB. `--aot v5e:16x16` predicts 423 ms per step, MFU 50.5 % (48.2 % counting
causal attention only), of which 146 ms are collectives the schedule leaves exposed (FSDP's all-gathers, the
replicated parameters' all-reduces); published runs measured 0.77-1.15x such predictions (docs/aot_planning.md).
"""

from configs.base import CheckpointConfig, Config, DataConfig, GuardConfig, MeshConfig, OptimConfig, TrainConfig
from gpt2.config import GPT2Config

CONFIG = Config(
    run_dir="runs/gpt2_xl",  # on a pod: storage every host sees: gs://bucket/path (docs/pods.md) or an NFS mount
    # document_mask: attention stops at each <|endoftext|> (splash's segment ids) and positions restart per
    # document; docs/training.md "Document masking" for the measured gain
    model=GPT2Config.gpt2_xl(pad_vocab_to=128, dtype="bfloat16", scan_layers=False, remat="dots",
                             document_mask=True, document_positions=True),
    data=DataConfig(dataset="/data/fineweb", num_workers=8, prefetch=4),
    optim=OptimConfig(lr=2e-4, warmup_steps=1000, min_lr_ratio=0.1),
    train=TrainConfig(
        steps=30_000, batch_size=1024, seq_len=1024, grad_accum=1, steps_per_call=1,
        eval_every=1000, eval_batches=20, sample_prompt="The meaning of life is",
    ),
    mesh=MeshConfig(data=4, fsdp=-1, tensor=1, rules="fsdp"),
    checkpoint=CheckpointConfig(every=500, keep=2, keep_every=5000),
    # skip loss spikes; after 16 skipped steps in a row, roll back and skip 200 batches (PaLM skipped 200-500)
    guard=GuardConfig(skip_spikes=True, rollback_after=16, rollback_skip=200),
)
