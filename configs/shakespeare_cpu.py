"""The default: a small GPT-2 on the embedded Shakespeare corpus, sized for a 2-core laptop CPU.

A few minutes on 2 cores (docs/training.md, "The default run, measured"). The full GPT-2 vocabulary is kept so
that checkpoints are ordinary GPT-2 checkpoints; it makes the embedding most of the 7.3M parameters.
"""

from configs.base import CheckpointConfig, Config, DataConfig, TrainConfig
from optim.adamw import AdamWConfig
from optim.schedules import CosineSchedule
from gpt2.config import GPT2Config

CONFIG = Config(
    run_dir="runs/shakespeare_cpu",
    # document_mask off: the 37 training works are ~37k tokens each, so 0.35% of rows hold a boundary; the mask
    # would change almost nothing here (docs/training.md "Document masking")
    model=GPT2Config(n_layer=4, n_head=4, n_embd=128, block_size=256, scan_layers=True, document_mask=False),
    data=DataConfig(dataset="shakespeare"),
    optim=AdamWConfig(lr=2e-3, weight_decay=0.1),
    schedule=CosineSchedule(warmup_steps=50, min_lr_ratio=0.1),
    train=TrainConfig(
        steps=600, batch_size=8, seq_len=128, steps_per_call=10,
        eval_every=100, eval_batches=8, sample_tokens=120,
    ),
    checkpoint=CheckpointConfig(every=200, keep=3),
)
