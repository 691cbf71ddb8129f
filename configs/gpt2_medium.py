"""GPT-2 medium (350M) on OpenWebText / FineWeb, on a TPU v5e-16 slice (4 hosts).

Sizing (checked with `--aot v5e:4x4`, docs/aot_planning.md): 0.5M tokens per step (512 × 1024) as 8
micro-batches of 64 sequences (4 per chip); FSDP over all 16 chips shards parameters, gradients and AdamW state
(~6 GB in float32 that would otherwise sit on every 16 GB chip next to the activations). Without remat the
activations of 8 sequences per chip need ~38 GB (the AOT report says so); full remat of each block trades ~1/3
more FLOPs for fitting with room to spare.
"""

from configs.base import CheckpointConfig, Config, DataConfig, GuardConfig, MeshConfig, OptimConfig, TrainConfig
from gpt2.config import GPT2Config

CONFIG = Config(
    run_dir="runs/gpt2_medium",
    # document_mask: attention stops at each <|endoftext|> (splash's segment ids) and positions restart per
    # document; docs/training.md "Document masking" for the measured gain
    model=GPT2Config.gpt2_medium(pad_vocab_to=128, dtype="bfloat16", scan_layers=True, remat="full",
                                 document_mask=True, document_positions=True),
    data=DataConfig(dataset="/data/openwebtext", num_workers=4, prefetch=4),
    optim=OptimConfig(lr=3e-4, warmup_steps=700, min_lr_ratio=0.1),
    train=TrainConfig(
        steps=19_000, batch_size=512, seq_len=1024, grad_accum=8, steps_per_call=10,
        eval_every=500, eval_batches=40, sample_prompt="The meaning of life is",
    ),
    mesh=MeshConfig(data=1, fsdp=-1, tensor=1, rules="fsdp"),
    checkpoint=CheckpointConfig(every=1000, keep=3, keep_every=5000),
    # skip loss spikes; after 16 skipped steps in a row, roll back and skip 200 batches (PaLM skipped 200-500)
    guard=GuardConfig(skip_spikes=True, rollback_after=16, rollback_skip=200),
)
