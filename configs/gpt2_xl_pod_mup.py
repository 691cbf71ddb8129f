"""GPT-2 XL (1.5B) on a TPU v5e-256 pod in μP, its learning rate taken from a CPU sweep (docs/mup.md).

gpt2_xl_pod's run (sizing: that preset and docs/aot_planning.md) with μP and optim.lr from the sweep.
`python -m benchmarks.mup_transfer` swept AdamW's rate on a 2-layer proxy on the embedded corpus at widths 64,
128 and 256 with μP based at width 128: the best rate was 2^-9 ≈ 1.95e-3 at every width (under the standard
parametrization it moved 4×, from 3.9e-3 to 9.8e-4). μP carries it to width 1600 from the same base width
(mup_base_width=128): the hidden matrices learn at 128/1600 of it (1.6e-4, beside gpt2_xl_pod's 2e-4 for every
parameter), the embeddings, norms and biases at all of it, and the logits are × 128/1600. What μP's theory does
not cover — 48 layers against 2, 1M tokens per step against 512, 30,000 steps against 100 — the sweep does not
measure either (docs/mup.md, "What the sweep does not show").
"""

from configs import extend
from configs.gpt2_xl_pod import CONFIG as GPT2_XL_POD

CONFIG = extend(
    GPT2_XL_POD,
    run_dir="runs/gpt2_xl_mup",
    model=dict(parametrization="mup", mup_base_width=128),
    optim=dict(lr=2**-9),  # the sweep's best: docs/mup.md, "The sweep"
)
