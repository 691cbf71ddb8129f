"""GPT-2 XL (1.5B) on a TPU v5e-256 pod in μP with CompleteP's depth scaling, its learning rate and μP's own
multipliers taken from the CPU proxy of `python -m benchmarks.mup_transfer` (docs/mup.md).

gpt2_xl_pod's run, based at that proxy: width 32 (m = 1600/32 = 50), head dim 16 (so the attention scale is
√16/64, μP's 1/K from there), 2 layers (each residual branch × 2/48). The proxy's base part tuned α_in, α_out and
AdamW's rate together at width 32 (docs/mup.md, "The sweep": the best rate holds within one 2× step at widths
32 … 256 and, with depth scaling, is the same at 2 … 8 layers); here the hidden matrices learn at lr/50
(PROXY_LR/50 ≈ 3e-4, beside gpt2_xl_pod's 2e-4), the embeddings, norms and biases at all of it. Adam's ε follows
CompleteP's rule for the hidden weights (Dey et al. 2025: ε/m · L_base/L), applied to every parameter (optax's Adam
has one ε). Extrapolated, not measured (docs/mup.md, "What is still extrapolated"): 1M tokens per step against 256,
30,000 steps against 100 (and the weight decay's lr·wd per step over them), a vocabulary of 50,257 against 1,024,
head dim 64 against 16: run a few rates around PROXY_LR on the pod before the long run.
"""

from configs import extend
from configs.gpt2_xl_pod import CONFIG as GPT2_XL_POD

BASE_WIDTH, BASE_HEAD_DIM, BASE_DEPTH = 32, 16, 2  # benchmarks/mup_transfer.py's Proxy
INPUT_MULT, OUTPUT_MULT, PROXY_LR = 30.0, 8.0, 2**-6  # the base part's best (docs/mup/mup_transfer.json)

WIDTH, DEPTH = GPT2_XL_POD.model.n_embd, GPT2_XL_POD.model.n_layer

CONFIG = extend(
    GPT2_XL_POD,
    run_dir="runs/gpt2_xl_mup",
    model=dict(parametrization="mup", mup_base_width=BASE_WIDTH, mup_base_head_dim=BASE_HEAD_DIM,
               mup_base_depth=BASE_DEPTH, mup_input_mult=INPUT_MULT, mup_output_mult=OUTPUT_MULT),
    # optax's Adam takes one ε, so every parameter gets the blocks' (a flag that shrinks the model keeps this one)
    optim=dict(lr=PROXY_LR, eps=1e-8 / (WIDTH / BASE_WIDTH) / (DEPTH / BASE_DEPTH)),
)
