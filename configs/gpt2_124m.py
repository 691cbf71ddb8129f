"""GPT-2 124M on OpenWebText / FineWeb, on a TPU v5e-8 or v4-8 slice (one host).

Prepare the data first (README "Data"), then: python train.py --config gpt2_124m --data.dataset=/data/owt

Sizing (checked with `--aot v5e:2x4`, see README): 0.5M tokens per optimizer step as in GPT-2/nanoGPT
(batch 512 × 1024 tokens) reached as 16 micro-batches of 32 sequences (4 per chip); pure data parallelism — 124M parameters
and their AdamW state (~2 GB in float32) fit every chip, so replicating them costs nothing and saves the
all-gathers FSDP would add. bfloat16 compute with float32 parameters; no remat is needed at 4 rows per chip per
micro-batch.
"""

from configs.base import CheckpointConfig, Config, DataConfig, GuardConfig, MeshConfig, OptimConfig, TrainConfig
from gpt2.config import GPT2Config

CONFIG = Config(
    run_dir="runs/gpt2_124m",
    model=GPT2Config.gpt2(pad_vocab_to=128, dtype="bfloat16", scan_layers=True),
    data=DataConfig(dataset="/data/openwebtext", num_workers=4, prefetch=4),
    optim=OptimConfig(lr=6e-4, warmup_steps=700, min_lr_ratio=0.1, weight_decay=0.1),
    train=TrainConfig(
        steps=19_000, batch_size=512, seq_len=1024, grad_accum=16, steps_per_call=10,
        eval_every=500, eval_batches=40, sample_prompt="The meaning of life is",
    ),
    mesh=MeshConfig(data=-1, fsdp=1, tensor=1, rules="dp"),
    checkpoint=CheckpointConfig(every=1000, keep=3, keep_every=5000),
    # skip loss spikes; after 16 skipped steps in a row, roll back and skip 200 batches (PaLM skipped 200-500)
    guard=GuardConfig(skip_spikes=True, rollback_after=16, rollback_skip=200),
)
