"""GPT-2 medium (350M) on OpenWebText / FineWeb, on a TPU v5e-16 slice (4 hosts): gpt2_124m's run, wider and deeper.

Sizing (checked with `python plan.py --config gpt2_medium --topology v5e:4x4`, docs/aot_planning.md): 0.5M tokens
per step (512 × 1024) as 8 micro-batches of 64 sequences (4 per chip); FSDP over all 16 chips shards parameters,
gradients and AdamW state (~6 GB in float32 that would otherwise sit on every 16 GB chip next to the activations).
Without remat the activations of 8 sequences per chip need ~38 GB (the AOT report says so); full remat of each
block trades ~1/3 more FLOPs for fitting with room to spare.
"""

from configs import extend
from configs.gpt2_124m import CONFIG as GPT2_124M

CONFIG = extend(
    GPT2_124M,
    run_dir="runs/gpt2_medium",
    model=dict(n_layer=24, n_head=16, n_embd=1024, scan_layers=True, remat="full"),
    optim=dict(lr=3e-4),
    mesh=dict(data=1, fsdp=-1, rules="fsdp"),
)
