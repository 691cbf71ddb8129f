"""Fine-tune OpenAI's GPT-2 on the embedded Shakespeare corpus (nanoGPT's `finetune_shakespeare`).

    python train.py --config shakespeare_finetune                      # GPT-2 124M from the hub (needs a network)
    python train.py --config shakespeare_finetune --init_from hub:openai-community/gpt2-xl   # nanoGPT's choice
    python train.py --config shakespeare_finetune --init_from runs/shakespeare_cpu/hf --train.seq_len=128

`--init_from` takes a Hugging Face directory (e.g. one written by `python -m tools.export_hf`) or `hub:NAME`;
the architecture is the checkpoint's. As in nanoGPT: a few steps at a small constant learning rate (3e-5, no
warmup, no decay), ~32K tokens per step, evaluation every 5 steps. Sized for one accelerator (124M: 32 × 1024
tokens as 4 micro-batches of 8); on the 2-core CPU a step of 124M takes minutes.
"""

from configs.base import CheckpointConfig, Config, DataConfig, TrainConfig
from optim.adamw import AdamWConfig
from optim.schedules import CosineSchedule
from gpt2.config import GPT2Config

CONFIG = Config(
    run_dir="runs/shakespeare_finetune",
    init_from="hub:openai-community/gpt2",
    model=GPT2Config.gpt2(scan_layers=True),  # replaced by the checkpoint's architecture
    data=DataConfig(dataset="shakespeare"),
    optim=AdamWConfig(lr=3e-5, weight_decay=0.1),
    schedule=CosineSchedule(warmup_steps=0, min_lr_ratio=1.0),  # constant
    train=TrainConfig(
        steps=20, batch_size=32, seq_len=1024, grad_accum=4, steps_per_call=5,
        eval_every=5, eval_batches=4, sample_prompt="ROMEO:", sample_tokens=100,
    ),
    checkpoint=CheckpointConfig(every=20, keep=1),
)
