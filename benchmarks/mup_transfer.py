"""μP's promise, measured on CPU: the best learning rate found at one width holds at the others.

    nice -n 5 python -m benchmarks.mup_transfer --out docs/mup   # the sweep of docs/mup.md (2,523 s, 2 shared cores)
    python -m benchmarks.mup_transfer --coord_check --out docs/mup   # mean |activation| per layer, widths 64 → 1024
    python -m benchmarks.mup_transfer --widths 64 128 --steps 20 --lrs 0.004 0.016 --out /tmp/mup   # a smoke run

The sweep trains the same GPT-2 (depth, heads, tokens, batches and seed the same; only the width differs) at each
width and learning rate, under the standard parametrization and μP, with AdamW (`optim.lr`) and with Muon
(`optim.muon_lr`; AdamW keeps the embeddings, norms and biases at MUON_ADAMW_LR), with the trainer's optimizer
(optim.unguarded), and records the validation loss after the last step. It writes
`<out>/mup_transfer.json` (every run; a re-run skips the runs already there), `mup_transfer.md` (the table) and
`mup_transfer.png` (validation loss vs learning rate, one line per width).

The corpus is the embedded Shakespeare (data/assets), its GPT-2 token ids renumbered by frequency and cut to a
vocabulary of 4,096 (the rarer 6 % of the tokens share the last id): with GPT-2's 50,257 the tied head would cost
more than the blocks whose width is being varied.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from configs.base import Config, DataConfig, TrainConfig
from optim import OptimizerConfig, unguarded
from optim.base import by_path
from optim.schedules import CosineSchedule
from gpt2 import GPT2Config
from gpt2.model import GPT2, next_token_loss

VOCAB = 4096
OPTIMIZERS = ("adamw", "muon")
PARAMETRIZATIONS = ("standard", "mup")
# AdamW's rate for the embeddings, norms and biases in the Muon runs: shakespeare_cpu_muon's
MUON_ADAMW_LR = 2e-3


@dataclasses.dataclass(frozen=True)
class Proxy:
    """What every run of the sweep shares; only the width and the learning rate vary."""

    n_layer: int = 2
    n_head: int = 2
    base_width: int = 128  # μP's base: its multipliers are 1 here (head dim 64, where μP's α/K is GPT-2's 1/√K)
    seq_len: int = 64
    batch_size: int = 8
    steps: int = 100
    warmup_steps: int = 10
    seed: int = 0
    val_batches: int = 8

    def config(self, optimizer: str, parametrization: str, width: int, lr: float) -> Config:
        model = GPT2Config(vocab_size=VOCAB, block_size=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                           n_embd=width, parametrization=parametrization, mup_base_width=self.base_width)
        rates = dict(lr=lr) if optimizer == "adamw" else dict(lr=MUON_ADAMW_LR, muon_lr=lr)
        optim = OptimizerConfig.variants[optimizer](**rates)
        train = TrainConfig(steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed)
        return Config(model=model, optim=optim, schedule=CosineSchedule(warmup_steps=self.warmup_steps), train=train)


# ---- the corpus -------------------------------------------------------------------------------


def compact_corpus(vocab: int = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    """The embedded corpus's train and validation tokens, renumbered: the vocab - 1 most frequent training ids
    become 0, 1, ...; every other id becomes vocab - 1."""
    from data.prepare import prepare_shakespeare

    directory = prepare_shakespeare(Path(DataConfig().cache_dir).expanduser(), quiet=True)
    train, val = (np.fromfile(Path(directory) / f"{split}.bin", dtype="<u2") for split in ("train", "val"))
    ids, counts = np.unique(train, return_counts=True)
    kept = ids[np.argsort(-counts, kind="stable")[: vocab - 1]]
    table = np.full(65536, vocab - 1, np.int32)
    table[kept] = np.arange(len(kept))
    return table[train], table[val]


def windows(tokens: np.ndarray, n: int, batch: int, seq: int, seed: int) -> np.ndarray:  # [n, B, T + 1]
    """n batches of random windows of seq + 1 tokens (the same for every run that passes the same seed)."""
    starts = np.random.default_rng(seed).integers(0, len(tokens) - seq - 1, (n, batch))
    return tokens[starts[..., None] + np.arange(seq + 1)]


# ---- the sweep --------------------------------------------------------------------------------


def train_lanes(proxy: Proxy, optimizer: str, parametrization: str, width: int, lrs: list[float],
                train: np.ndarray, val: np.ndarray) -> list[dict]:
    """One run per learning rate, all in one program (vmapped over the rates: one compilation per width, not per
    run), each from the same init on the same batches `train` ([steps, B, T + 1]) with train.py's optimizer
    (optim.unguarded: clipping, warmup and cosine, μP's multipliers); each run's mean validation loss over `val`
    ([n, B, T + 1]) after the last step, inf if it diverged."""
    cfg = proxy.config(optimizer, parametrization, width, 1.0)
    graphdef, params = nnx.split(GPT2(cfg.model, rngs=nnx.Rngs(proxy.seed)))
    # The swept rate enters the update linearly (optax.scale_by_learning_rate of a warmup-cosine schedule, linear
    # in its peak), so run r's update is lr_r × the update at rate 1: one optimizer serves every run.
    tx = unguarded(cfg.optim, cfg.schedule, proxy.steps, cfg.model.mup_width_mult)
    # the swept group: Muon's matrices, or every parameter under AdamW
    swept = jax.tree.map(lambda _: True, params) if optimizer == "adamw" else by_path(
        params, lambda path, v: cfg.optim.group_of(path, v) == "lr/muon")

    def loss(p, batch):
        return next_token_loss(nnx.merge(graphdef, p), batch)

    def train_step(lr, p, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, opt_state = tx.update(grads, opt_state, p)
        updates = jax.tree.map(lambda u, is_swept: u * lr if is_swept else u, updates, swept)
        return optax.apply_updates(p, updates), opt_state, value

    @jax.jit
    def run(lrs, params, batches):
        opt_state = jax.vmap(tx.init)(params)

        def body(carry, batch):
            p, o, last = jax.vmap(train_step, (0, 0, 0, None))(lrs, *carry, batch)
            return (p, o), last

        (params, _), losses = jax.lax.scan(body, (params, opt_state), batches)
        val_loss = jax.vmap(lambda p: jax.lax.map(lambda b: loss(p, b), val).mean())(params)
        return losses[-10:].mean(0), val_loss

    runs = len(lrs)
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (runs, *x.shape)), params)
    train_loss, val_loss = jax.device_get(run(jnp.asarray(lrs, jnp.float32), stacked, jnp.asarray(train)))
    finite = np.isfinite(train_loss) & np.isfinite(val_loss)
    return [{"train_loss": float(t) if ok else math.inf, "val_loss": float(v) if ok else math.inf}
            for t, v, ok in zip(train_loss, val_loss, finite)]


def sweep(proxy: Proxy, widths, lrs: dict[str, list[float]], out: Path, optimizers=OPTIMIZERS,
          parametrizations=PARAMETRIZATIONS) -> list[dict]:
    """Every (optimizer, parametrization, width, lr) run, appended to <out>/mup_transfer.json as it finishes; runs
    already recorded there for the same proxy are not run again."""
    path = out / "mup_transfer.json"
    records = json.loads(path.read_text())["runs"] if path.exists() else []
    if records and json.loads(path.read_text())["proxy"] != dataclasses.asdict(proxy):
        raise SystemExit(f"{path} holds runs of another proxy; choose another --out")
    done = {(r["optimizer"], r["parametrization"], r["width"], r["lr"]) for r in records}
    train_tokens, val_tokens = compact_corpus()
    train = windows(train_tokens, proxy.steps, proxy.batch_size, proxy.seq_len, seed=proxy.seed)
    val = windows(val_tokens, proxy.val_batches, proxy.batch_size, proxy.seq_len, seed=proxy.seed + 1)
    for optimizer in optimizers:
        for parametrization in parametrizations:
            for width in widths:
                todo = [lr for lr in lrs[optimizer] if (optimizer, parametrization, width, lr) not in done]
                if not todo:
                    continue
                started = time.perf_counter()
                results = train_lanes(proxy, optimizer, parametrization, width, todo, train, val)
                seconds = round(time.perf_counter() - started, 1)
                for lr, result in zip(todo, results):
                    records.append({"optimizer": optimizer, "parametrization": parametrization, "width": width,
                                    "lr": lr, **result})
                print(json.dumps({"optimizer": optimizer, "parametrization": parametrization, "width": width,
                                  "seconds": seconds, "val_loss": [r["val_loss"] for r in results]}), flush=True)
                path.write_text(json.dumps({"proxy": dataclasses.asdict(proxy), "runs": records}, indent=1))
    return records


def best_lrs(records: list[dict]) -> dict[tuple[str, str], dict[int, float]]:
    """The learning rate of the lowest validation loss, per (optimizer, parametrization) and width."""
    best: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        at = best.setdefault((r["optimizer"], r["parametrization"]), {})
        if r["width"] not in at or r["val_loss"] < at[r["width"]]["val_loss"]:
            at[r["width"]] = r
    return {key: {w: r["lr"] for w, r in sorted(at.items())} for key, at in best.items()}


def table(records: list[dict]) -> str:
    """Markdown: validation loss per learning rate and width, the best of each width in bold; the best rate's
    spread (largest / smallest over the widths) per optimizer and parametrization."""
    lines, best = [], best_lrs(records)
    for (optimizer, parametrization), at in best.items():
        runs = [r for r in records if (r["optimizer"], r["parametrization"]) == (optimizer, parametrization)]
        widths, lrs = sorted({r["width"] for r in runs}), sorted({r["lr"] for r in runs})
        loss = {(r["width"], r["lr"]): r["val_loss"] for r in runs}
        rate = "optim.lr" if optimizer == "adamw" else "optim.muon_lr"
        spread = max(at.values()) / min(at.values())
        lines += [f"**{optimizer}, {parametrization}**: best {rate} by width "
                  + ", ".join(f"{w}: {lr:g}" for w, lr in at.items()) + f" (spread {spread:g}×)", "",
                  f"| {rate} | " + " | ".join(f"width {w}" for w in widths) + " |",
                  "|---:|" + "---:|" * len(widths)]
        for lr in lrs:
            cells = []
            for w in widths:
                value = loss.get((w, lr))
                text = "—" if value is None else ("diverged" if not math.isfinite(value) else f"{value:.3f}")
                cells.append(f"**{text}**" if at.get(w) == lr else text)
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    """Validation loss vs learning rate, one line per width; a panel per optimizer × parametrization."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(o, p) for o in OPTIMIZERS for p in PARAMETRIZATIONS
            if any((r["optimizer"], r["parametrization"]) == (o, p) for r in records)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    best = best_lrs(records)
    for ax, key in zip(axes[0], keys):
        runs = [r for r in records if (r["optimizer"], r["parametrization"]) == key]
        finite = [r["val_loss"] for r in runs if math.isfinite(r["val_loss"])]
        for w in sorted({r["width"] for r in runs}):
            line = sorted((r["lr"], r["val_loss"]) for r in runs if r["width"] == w)
            (drawn,) = ax.plot([lr for lr, _ in line], [v for _, v in line], "o-", ms=3, label=f"width {w}")
            ax.axvline(best[key][w], color=drawn.get_color(), lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5))
        ax.set_xlabel("optim.lr" if key[0] == "adamw" else "optim.muon_lr")
        ax.set_title(f"{key[0]}, {key[1]}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the coordinate check (Tensor Programs V, appendix D.1) ----------------------------------


def layer_outputs(model: GPT2, idx: jax.Array) -> dict[str, jax.Array]:
    """Every layer's output on idx ([B, T]): the embedding, each block's attention and MLP branch, the logits.
    The forward pass of an unscanned model, one branch at a time (tests check it gives model(idx)'s logits)."""
    x = model._embed(idx, start=0)
    out = {"embedding": x}
    for i, block in enumerate(model.h):
        a, _ = block.attn(block.ln_1(x))
        x = x + a
        m = block.mlp(block.ln_2(x))
        x = x + m
        out |= {f"h{i}.attn": a, f"h{i}.mlp": m}
    return out | {"logits": model._head(x)}


def coordinate_check(parametrization: str, widths, *, tokens: np.ndarray, optimizer: str = "adamw",
                     lr: float = 3e-3, steps: int = 4, n_layer: int = 2, n_head: int = 4, base_width: int = 64,
                     batch: int = 4, seq: int = 32, vocab: int = 256, seed: int = 0) -> dict[int, dict[str, list]]:
    """Mean |activation| of every layer's output at each of `steps` training steps (step 0: at init; the
    optimizer at a constant `lr` from the first step, no clipping or decay), per width: {width: {layer: [..]}}.
    The same batches (from `tokens`, ids < vocab) and seed at every width; μP based at the narrowest width."""
    data = windows(tokens, steps, batch, seq, seed)
    found = {}
    for width in widths:
        cfg = GPT2Config(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=width,
                         scan_layers=False, parametrization=parametrization, mup_base_width=base_width)
        graphdef, params = nnx.split(GPT2(cfg, rngs=nnx.Rngs(seed)))
        rates = dict(lr=lr) if optimizer == "adamw" else dict(lr=MUON_ADAMW_LR, muon_lr=lr)
        tx = unguarded(OptimizerConfig.variants[optimizer](weight_decay=0.0, grad_clip=0.0, **rates),
                       CosineSchedule(warmup_steps=0, min_lr_ratio=1.0), steps, cfg.mup_width_mult)

        @jax.jit
        def step(params, opt_state, batch):
            means = {k: jnp.abs(v).mean() for k, v in layer_outputs(nnx.merge(graphdef, params), batch[:, :-1]).items()}
            grads = jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), batch))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, means

        opt_state, history = tx.init(params), []
        for batch in data:
            params, opt_state, means = step(params, opt_state, jnp.asarray(batch))
            history.append(means)
        found[width] = {k: [float(h[k]) for h in history] for k in history[0]}
    return found


def plot_coordinates(found: dict[str, dict[int, dict[str, list]]], path: Path) -> None:
    """Mean |activation| vs width at each step, one panel per layer kind and parametrization."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("embedding", "attn", "mlp", "logits")
    fig, axes = plt.subplots(len(found), len(kinds), figsize=(3.3 * len(kinds), 3.0 * len(found)), squeeze=False)
    for row, (parametrization, by_width) in zip(axes, found.items()):
        widths = sorted(by_width)
        layers = list(by_width[widths[0]])
        steps = len(by_width[widths[0]][layers[0]])
        for ax, kind in zip(row, kinds):
            for layer in (name for name in layers if name.endswith(kind)):
                for t in range(steps):
                    ax.plot(widths, [by_width[w][layer][t] for w in widths], "o-", ms=2, lw=1,
                            color=plt.cm.viridis(t / max(steps - 1, 1)), label=f"t={t}" if layer == layers[0] or
                            layer.startswith("h0") else None)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{parametrization}: {kind}", fontsize=9)
            ax.set_xlabel("width")
        row[0].set_ylabel("mean |activation|")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command ------------------------------------------------------------------------------


DEFAULT_LRS = {"adamw": [2.0**-k for k in range(11, 5, -1)], "muon": [2.0**-k for k in range(7, 1, -1)]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mup_transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/mup_transfer", help="where the JSON, table and PNG go")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="sweep: 64 128 256; coord check: 64 … 1024")
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="the rates swept (default: per optimizer)")
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--steps", type=int, default=Proxy.steps, help="sweep: training steps per run")
    p.add_argument("--coord_steps", type=int, default=4, help="coordinate check: steps recorded (the first at init)")
    p.add_argument("--coord_check", action="store_true", help="the coordinate check instead of the sweep")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.coord_check:
        tokens = compact_corpus(256)[0]
        widths = args.widths or [64, 128, 256, 512, 1024]
        found = {param: coordinate_check(param, widths, tokens=tokens, steps=args.coord_steps)
                 for param in PARAMETRIZATIONS}
        (out / "coord_check.json").write_text(json.dumps({p: {str(w): v for w, v in f.items()}
                                                          for p, f in found.items()}, indent=1))
        plot_coordinates(found, out / "coord_check.png")
    else:
        proxy = Proxy(steps=args.steps, warmup_steps=max(1, args.steps // 10))
        lrs = {o: args.lrs or DEFAULT_LRS[o] for o in OPTIMIZERS}
        records = sweep(proxy, args.widths or [64, 128, 256], lrs, out, optimizers=args.optimizers)
        (out / "mup_transfer.md").write_text(table(records))
        plot(records, out / "mup_transfer.png")
        print(table(records))
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s (jax {jax.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
