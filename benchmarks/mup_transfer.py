"""μP's promise, measured on CPU: the learning rate tuned at a narrow width (and depth) is the best one wider (and
deeper), and the wide μP model is at least as good as the standard model tuned at its own width.

    python -m benchmarks.mup_transfer --out docs/mup   # the tables and plot of docs/mup.md: 828 s on 2 CPU cores
    python -m benchmarks.mup_transfer --coord_check --out docs/mup   # every layer's change from init, by width/depth
    python -m benchmarks.mup_transfer --parts width --optimizers adamw --steps 20 --out /tmp/mup   # a smoke run

Three parts, each a table of the validation loss (mean ± standard deviation over the seeds) by learning rate:
`base`, μP's own hyperparameters α_in and α_out around the proxy's at the base width; `width`, the standard
parametrization and μP at widths 32 … 256 (heads growing at a fixed head dim), with AdamW (`optim.lr`) and Muon
(`optim.muon_lr`, AdamW's rate MUON_ADAMW_RATIO of it); `depth`, μP at 2 … 8 layers with and without CompleteP's
depth scaling (`model.mup_base_depth`). Every run of a line (its rates × seeds) trains in one vmapped program with
the trainer's optimizer (optim.unguarded); seed s draws the init and the batches. It writes `<out>/mup_transfer.json`
(every run; a re-run skips the lines already there), `mup_transfer.md` (the tables) and `mup_transfer.png`.

The corpus is the embedded Shakespeare (data/assets), its GPT-2 token ids renumbered by frequency and cut to a
vocabulary of 1,024 (the rarer ids share the last): with GPT-2's 50,257 the tied head would cost more than the
blocks whose width is being varied.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
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

from configs.base import DataConfig
from optim import OptimizerConfig, unguarded
from optim.schedules import CosineSchedule
from gpt2 import GPT2Config
from gpt2.model import GPT2, next_token_loss

OPTIMIZERS = ("adamw", "muon")
MUON_ADAMW_RATIO = 0.1  # AdamW's rate (embeddings, norms, biases) in a Muon run, as a share of the swept muon_lr
# the rates swept, around each optimum (the standard parametrization's moves down with the width; μP's, with
# α_in = 30, sits higher)
LRS = {("adamw", "standard"): [2.0**-k for k in range(12, 5, -1)], ("adamw", "mup"): [2.0**-k for k in range(9, 3, -1)],
       ("muon", "standard"): [2.0**-k for k in range(6, 1, -1)], ("muon", "mup"): [2.0**-k for k in range(6, 2, -1)]}
WIDTHS, DEPTHS, DEPTH_WIDTH = (32, 64, 128, 256), (2, 4, 8), 32  # depth scaling's base: the first depth
MULTS = (30.0, 8.0)  # μP's (α_in, α_out) where the base part is not run: its best (docs/mup.md)
# the base part: GPT-2's multipliers, then (α_in, α_out) one at a time around the best
BASE_GRID = [(1.0, 1.0), (1.0, 8.0), (3.0, 8.0), (10.0, 8.0), (30.0, 8.0), (100.0, 8.0), (30.0, 2.0), (30.0, 32.0)]


@dataclasses.dataclass(frozen=True)
class Proxy:
    """What every run shares; a line varies the parametrization, the width or depth, the rate and the seed."""

    n_layer: int = 2
    head_dim: int = 16  # the heads grow with the width, as GPT-2's sizes do
    base_width: int = 32  # μP's base: the width multipliers are 1 here
    vocab: int = 1024
    seq_len: int = 64
    batch_size: int = 4
    steps: int = 100
    warmup_steps: int = 10
    val_batches: int = 16  # of 8 × seq_len tokens, the same windows for every run
    seeds: tuple[int, ...] = (0, 1, 2)

    def model(self, parametrization: str, width: int, *, n_layer: int | None = None, depth_scaling: bool = False,
              mults: tuple[float, float] = MULTS) -> GPT2Config:
        mup = dict(parametrization="mup", mup_base_width=self.base_width,
                   mup_base_depth=self.n_layer if depth_scaling else None, mup_input_mult=mults[0],
                   mup_output_mult=mults[1])
        return GPT2Config(vocab_size=self.vocab, block_size=self.seq_len, n_layer=n_layer or self.n_layer,
                          n_head=width // self.head_dim, n_embd=width, **(mup if parametrization == "mup" else {}))


def optimizer(name: str, **kw) -> OptimizerConfig:
    """The optimizer at rate 1 (a lane multiplies its update by its own rate): AdamW, or Muon with AdamW's group at
    MUON_ADAMW_RATIO."""
    rates = dict(lr=1.0) if name == "adamw" else dict(lr=MUON_ADAMW_RATIO, muon_lr=1.0)
    return OptimizerConfig.variants[name](**rates, **kw)


# ---- the corpus -------------------------------------------------------------------------------


def compact_corpus(vocab: int) -> tuple[np.ndarray, np.ndarray]:
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


# ---- training: one program per line ---------------------------------------------------------


def train_lanes(proxy: Proxy, model: GPT2Config, optimizer_name: str, lrs: list[float], corpus) -> np.ndarray:
    """The validation loss of every (rate, seed) run of one line after proxy.steps steps ([rates, seeds]; inf where
    a run diverged), all in one program: vmapped over the runs, each from its seed's init on its seed's batches.
    The rate enters optax's update linearly (scale_by_learning_rate of a warmup-cosine schedule linear in its peak),
    so run r's update is its rate × the update at rate 1 of one optimizer, train.py's own (optim.unguarded)."""
    train_tokens, val_tokens = corpus
    tx = unguarded(optimizer(optimizer_name), CosineSchedule(warmup_steps=proxy.warmup_steps), proxy.steps,
                   model.mup_width_mult)
    graphdef, inits = seed_inits(model, proxy.seeds)
    lanes = list(itertools.product(range(len(lrs)), range(len(proxy.seeds))))  # (rate, seed) per run
    seed_of = [s for _, s in lanes]
    params = jax.tree.map(lambda *per_seed: jnp.stack([per_seed[s] for s in seed_of]), *inits)
    batches = np.stack([windows(train_tokens, proxy.steps, proxy.batch_size, proxy.seq_len, seed=1000 + seed)
                        for seed in proxy.seeds])[seed_of].swapaxes(0, 1)  # [steps, runs, B, T + 1]
    val = jnp.asarray(windows(val_tokens, proxy.val_batches, 8, proxy.seq_len, seed=99))

    def loss(p, batch):
        return next_token_loss(nnx.merge(graphdef, p), batch)

    @jax.jit
    def run(lrs, params, batches):
        def body(carry, batch):
            return jax.vmap(functools.partial(step_at_rate, tx, graphdef))(lrs, *carry, batch), None

        (params, _), _ = jax.lax.scan(body, (params, jax.vmap(tx.init)(params)), batches)
        return jax.vmap(lambda p: jax.lax.map(lambda b: loss(p, b), val).mean())(params)

    rates = jnp.asarray([lrs[r] for r, _ in lanes], jnp.float32)
    found = np.asarray(jax.device_get(run(rates, params, jnp.asarray(batches))), np.float64)
    return np.where(np.isfinite(found), found, np.inf).reshape(len(lrs), len(proxy.seeds))


def seed_inits(model: GPT2Config, seeds) -> tuple[nnx.GraphDef, list[nnx.State]]:
    """The model's graph and each seed's initial state (seed s draws run s's init)."""
    inits = [nnx.split(GPT2(model, rngs=nnx.Rngs(seed))) for seed in seeds]
    return inits[0][0], [state for _, state in inits]


def step_at_rate(tx: optax.GradientTransformation, graphdef: nnx.GraphDef, lr, params, opt_state, batch):
    """One step of `tx` (set up at rate 1) on `batch`, its update × lr: the step at rate lr, since the rate enters
    optax's update linearly. (params, opt_state) after it."""
    grads = jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p), batch))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, jax.tree.map(lambda u: lr * u, updates)), opt_state


def lines(parts, optimizers) -> list[dict]:
    """Every line of the sweep: what varies besides the rate and the seed."""
    out = []
    if "base" in parts:
        out += [dict(part="base", optimizer="adamw", parametrization="mup", width=Proxy.base_width,
                     n_layer=Proxy.n_layer, depth_scaling=False, mults=list(m)) for m in BASE_GRID]
    if "width" in parts:
        out += [dict(part="width", optimizer=o, parametrization=p, width=w, n_layer=Proxy.n_layer,
                     depth_scaling=False, mults=None)
                for o in optimizers for p in ("standard", "mup") for w in WIDTHS]
    if "depth" in parts:
        out += [dict(part="depth", optimizer="adamw", parametrization="mup", width=DEPTH_WIDTH, n_layer=n,
                     depth_scaling=s, mults=None) for s in (False, True) for n in DEPTHS if not s or n != DEPTHS[0]]
    return out


def sweep(proxy: Proxy, todo: list[dict], out: Path) -> list[dict]:
    """Every line's runs, appended to <out>/mup_transfer.json as each line finishes; lines already recorded there for
    the same proxy are not run again. The base part runs first; μP's lines after it take its best (α_in, α_out)."""
    path = out / "mup_transfer.json"
    saved = json.loads(path.read_text()) if path.exists() else {"proxy": _jsonable(proxy), "lines": []}
    if saved["proxy"] != _jsonable(proxy):
        raise SystemExit(f"{path} holds runs of another proxy; choose another --out")
    corpus, done = compact_corpus(proxy.vocab), []
    for line in todo:
        if line["mults"] is None and line["parametrization"] == "mup":  # the base part's best, or MULTS
            base = transferred(done)
            line = {**line, "mults": [base["mup_input_mult"], base["mup_output_mult"]] if base else list(MULTS)}
        if (record := next((r for r in saved["lines"] if _key(r) == _key(line)), None)) is None:
            started = time.perf_counter()
            model = proxy.model(line["parametrization"], line["width"], n_layer=line["n_layer"],
                                depth_scaling=line["depth_scaling"], mults=tuple(line["mults"] or MULTS))
            lrs = LRS[line["optimizer"], line["parametrization"]]
            loss = train_lanes(proxy, model, line["optimizer"], lrs, corpus)
            record = {**line, "lrs": lrs, "val_loss": loss.tolist(),
                      "seconds": round(time.perf_counter() - started, 1)}
            saved["lines"].append(record)
            print(json.dumps({k: v for k, v in record.items() if k not in ("lrs", "val_loss")}), flush=True)
            path.write_text(json.dumps(saved, indent=1))
        done.append(record)
    # the parts run keep their lines only (a line of another grid or other multipliers is dropped)
    saved["lines"] = [r for r in saved["lines"] if r["part"] not in {t["part"] for t in todo}] + done
    path.write_text(json.dumps(saved, indent=1))
    return done


def transferred(records: list[dict]) -> dict | None:
    """What μP's lines and a preset take from the base part: its best (α_in, α_out), the one of the lowest mean loss
    at its best rate, and that rate (None without a base part)."""
    base = [r for r in records if r["part"] == "base"]
    if not base:
        return None
    line = min(base, key=lambda r: np.asarray(r["val_loss"]).mean(1).min())
    return {"mup_input_mult": line["mults"][0], "mup_output_mult": line["mults"][1], "lr": line["lrs"][best(line)[0]]}


def _key(line: dict) -> tuple:
    return tuple(json.dumps(line[k]) for k in ("part", "optimizer", "parametrization", "width", "n_layer",
                                               "depth_scaling", "mults"))


def _jsonable(proxy: Proxy) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(proxy)))


# ---- the tables and the plot ------------------------------------------------------------------


def best(line: dict) -> tuple[int, np.ndarray]:
    """The index of the rate with the lowest mean validation loss over the seeds, and its per-seed losses."""
    loss = np.asarray(line["val_loss"])
    i = int(np.argmin(loss.mean(axis=1)))
    return i, loss[i]


def _cell(values: np.ndarray) -> str:
    if not np.isfinite(values).all():
        return "diverged"
    return f"{values.mean():.3f} ± {values.std(ddof=1):.3f}"


def loss_table(group: list[dict], column: str, title: str) -> list[str]:
    """Markdown: mean ± std over seeds by rate (rows) and `column` (width or n_layer); each column's best in bold."""
    lrs, rate = group[0]["lrs"], "optim.lr" if group[0]["optimizer"] == "adamw" else "optim.muon_lr"
    by = {line[column]: line for line in group}
    bests = {c: best(line)[0] for c, line in by.items()}
    lines = [f"**{title}**: best {rate} by {column} " + ", ".join(f"{c}: {lrs[i]:g}" for c, i in bests.items()), "",
             f"| {rate} | " + " | ".join(f"{column} {c}" for c in by) + " |", "|---:|" + "---:|" * len(by)]
    for i, lr in enumerate(lrs):
        cells = [_cell(np.asarray(line["val_loss"][i])) for line in by.values()]
        lines.append(f"| {lr:g} | " + " | ".join(f"**{t}**" if bests[c] == i else t for c, t in zip(by, cells)) + " |")
    return lines + [""]


def comparison(standard: list[dict], mup: list[dict]) -> list[str]:
    """Per width: each parametrization's best (rate, loss), μP − standard per seed at their best rates, and μP's best
    minus its best at the width before, per seed (wider is better where that is below 0 beyond its spread)."""
    out = ["| width | standard: best rate | standard: loss | μP: best rate | μP: loss | μP − standard (paired) |"
           " μP − μP a width before (paired) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    before = None
    for s, m in zip(standard, mup):
        (i, a), (j, b) = best(s), best(m)
        wider = "—" if before is None else _cell(b - before)
        out.append(f"| {s['width']} | {s['lrs'][i]:g} | {_cell(a)} | {m['lrs'][j]:g} | {_cell(b)} | {_cell(b - a)} |"
                   f" {wider} |")
        before = b
    return out + [""]


def tables(records: list[dict]) -> str:
    text = []
    base = [r for r in records if r["part"] == "base"]
    if base:
        text += ["**base width: μP's α_in and α_out** (AdamW, width 32)", "",
                 "| α_in | α_out | best optim.lr | loss |", "|---:|---:|---:|---:|"]
        for r in base:
            i, loss = best(r)
            text.append(f"| {r['mults'][0]:g} | {r['mults'][1]:g} | {r['lrs'][i]:g} | {_cell(loss)} |")
        chosen = transferred(records)
        text += ["", f"μP's lines below take the best: α_in = {chosen['mup_input_mult']:g}, α_out ="
                 f" {chosen['mup_output_mult']:g} (its rate there: {chosen['lr']:g}).", ""]
    for o in OPTIMIZERS:
        group = {p: [r for r in records if (r["part"], r["optimizer"], r["parametrization"]) == ("width", o, p)]
                 for p in ("standard", "mup")}
        for p, lines_ in group.items():
            if lines_:
                text += loss_table(lines_, "width", f"{o}, {p}")
        if group["standard"] and group["mup"]:
            text += [f"**{o}: μP against the standard parametrization, each at its best rate**", ""]
            text += comparison(group["standard"], group["mup"])
    for scaling in (False, True):
        group = [r for r in records if r["part"] == "depth" and (r["depth_scaling"] == scaling
                                                                 or r["n_layer"] == DEPTHS[0])]
        if group:
            text += loss_table(group, "n_layer", "adamw, μP " + ("with CompleteP's depth scaling (base depth 2)"
                                                                  if scaling else "in width only"))
    return "\n".join(text)


def plot(records: list[dict], path: Path) -> None:
    """Validation loss vs learning rate, one line per width (or depth), the seeds' spread as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{o}, {p}", "width", [r for r in records if (r["part"], r["optimizer"], r["parametrization"])
                                      == ("width", o, p)]) for o in OPTIMIZERS for p in ("standard", "mup")]
    panels += [(f"adamw, μP, depth {'scaled' if s else 'unscaled'}", "n_layer",
                [r for r in records if r["part"] == "depth" and (r["depth_scaling"] == s or r["n_layer"] == DEPTHS[0])])
               for s in (False, True)]
    panels = [p for p in panels if p[2]]
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, column, group) in zip(axes.flat, panels):
        finite = [v for r in group for v in np.asarray(r["val_loss"]).mean(1) if np.isfinite(v)]
        for r in group:
            loss = np.asarray(r["val_loss"])
            ok = np.isfinite(loss).all(1)
            lrs = np.asarray(r["lrs"])[ok]
            (drawn,) = ax.plot(lrs, loss[ok].mean(1), "o-", ms=3, label=f"{column} {r[column]}")
            ax.fill_between(lrs, loss[ok].mean(1) - loss[ok].std(1, ddof=1), loss[ok].mean(1) + loss[ok].std(
                1, ddof=1), color=drawn.get_color(), alpha=0.2, lw=0)
            ax.axvline(r["lrs"][best(r)[0]], color=drawn.get_color(), lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 0.8))
        ax.set_xlabel("optim.lr" if title.startswith("adamw") else "optim.muon_lr")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for row in axes:
        row[0].set_ylabel("validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the coordinate check (Tensor Programs V, appendix D.1) ----------------------------------

KINDS = ("embedding", "attn_logits", "attn", "mlp", "residual", "logits")


def layer_outputs(model: GPT2, idx: jax.Array) -> dict[str, jax.Array]:
    """Every layer's output on idx ([B, T]) of an unscanned model, one branch at a time: the embedding; each block's
    queries and keys (each × √scale, so that their product is the attention logits), its attention and MLP branches
    (before the depth multiplier); the stream after the last block; the logits (tests: they are model(idx)'s)."""
    x = model._embed(idx, start=0)
    out = {"embedding": x}
    for i, block in enumerate(model.h):
        h = block.ln_1(x)
        qkv = block.attn.c_attn(h) * math.sqrt(block.attn.scale)  # [B, T, 3, H, K]
        out |= {f"h{i}.query": qkv[:, :, 0], f"h{i}.key": qkv[:, :, 1]}
        a = block.attn(h)[0]
        m = block.mlp(block.ln_2(x + block.branch_scale * a))
        x = x + block.branch_scale * (a + m)
        out |= {f"h{i}.attn": a, f"h{i}.mlp": m}
    return out | {"residual": x, "logits": model._head(x)}


def coordinate_check(models: dict[int, GPT2Config], *, tokens: np.ndarray, steps: int = 4, seeds=(0, 1),
                     lr: float = 1e-2, batch: int = 4, seq: int = 32) -> dict[int, dict[str, list[float]]]:
    """How far every layer's output moves from its value at init, mean |f_t(x) − f_0(x)| over the coordinates of a
    fixed batch x, after each of `steps` AdamW steps at a constant `lr` (no clipping or decay), averaged over the
    seeds (each its own init and batches from `tokens`): {size: {layer: [after step 1, 2, ...]}} for each
    (unscanned) model config. Under μP every entry stays put as the width grows, and under depth scaling as the
    depth grows; each known mistake makes some of them grow or shrink (tests/unit/test_mup.py)."""
    found = {}
    for size, cfg in models.items():
        graphdef, inits = seed_inits(cfg, seeds)
        params = jax.tree.map(lambda *per_seed: jnp.stack(per_seed), *inits)
        data = jnp.asarray(np.stack([windows(tokens, steps, batch, seq, seed=seed) for seed in seeds]))
        tx = unguarded(optimizer("adamw", weight_decay=0.0, grad_clip=0.0),
                       CosineSchedule(warmup_steps=0, min_lr_ratio=1.0), steps, cfg.mup_width_mult)

        def one_seed(p, batches):  # [steps, B, T + 1] -> {layer: [steps]}
            probe = batches[0, :, :-1]
            start = layer_outputs(nnx.merge(graphdef, p), probe)

            def body(carry, batch):
                p, opt_state = step_at_rate(tx, graphdef, lr, *carry, batch)
                now = layer_outputs(nnx.merge(graphdef, p), probe)
                return (p, opt_state), changes(start, now)

            return jax.lax.scan(body, (p, tx.init(p)), batches)[1]

        moved = jax.device_get(jax.jit(jax.vmap(one_seed))(params, data))  # {layer: [seeds, steps]}
        found[size] = {k: np.asarray(v).mean(0).tolist() for k, v in moved.items()}
    return found


def changes(start: dict[str, jax.Array], now: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Mean |now − start| of every layer output; of the attention logits, their learned part Δq·Δk × scale, which
    grows as √K if the scale is 1/√K (the terms q₀·Δk and Δq·k₀ vanish as 1/√K under μP's 1/K: small proxies after a
    few steps are dominated by them, and would hide a wrong scale)."""
    out = {k: jnp.abs(now[k] - start[k]).mean() for k in now if not k.endswith((".query", ".key"))}
    for query in (k for k in now if k.endswith(".query")):
        layer = query.removesuffix(".query")
        dq, dk = now[query] - start[query], now[f"{layer}.key"] - start[f"{layer}.key"]
        out[f"{layer}.attn_logits"] = jnp.abs(jnp.einsum("bthk,bshk->bhts", dq, dk)).mean()
    return out


def by_kind(found: dict[int, dict[str, list]]) -> dict[str, np.ndarray]:
    """{kind: [sizes, steps]}: each of KINDS, averaged over the blocks where there is one per block."""
    sizes = sorted(found)
    return {kind: np.array([np.mean([v for k, v in found[s].items() if k.split(".")[-1] == kind], axis=0)
                            for s in sizes]) for kind in KINDS}


def coordinate_models(check: str, variant: str) -> dict[int, GPT2Config]:
    """The models of the CLI's coordinate check: by width (2 heads, so the head dim grows too and the attention scale
    is seen), standard or μP (base 32); by depth (width 64), μP without or with depth scaling (base depth 2)."""
    common = dict(vocab_size=256, block_size=32, scan_layers=False)
    mup = dict(parametrization="mup", mup_base_width=32, mup_base_head_dim=16)
    if check == "width":
        return {w: GPT2Config(n_layer=2, n_head=2, n_embd=w, **common, **(mup if variant == "mup" else {}))
                for w in (32, 64, 128, 256, 512)}
    depth = dict(mup_base_depth=2) if variant == "scaled" else {}
    return {n: GPT2Config(n_layer=n, n_head=4, n_embd=64, **common, **mup, **depth) for n in (2, 4, 8, 16)}


def plot_coordinates(found: dict[str, dict[int, dict[str, list]]], path: Path) -> None:
    """Mean |change from init| vs size after each step, one panel per kind of layer and check."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(found), len(KINDS), figsize=(2.9 * len(KINDS), 2.6 * len(found)), squeeze=False)
    for row, (name, by_size) in zip(axes, found.items()):
        sizes, kinds = sorted(by_size), by_kind(by_size)
        for ax, kind in zip(row, KINDS):
            for t in range(kinds[kind].shape[1]):
                ax.plot(sizes, kinds[kind][:, t], "o-", ms=2, lw=1, label=f"step {t + 1}",
                        color=plt.cm.viridis(t / max(kinds[kind].shape[1] - 1, 1)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}: {kind}", fontsize=8)
            ax.set_xlabel("n_layer" if name.startswith("depth") else "width", fontsize=8)
        row[0].set_ylabel("mean |Δ from init|", fontsize=8)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the command ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mup_transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/mup_transfer", help="where the JSON, tables and PNG go")
    p.add_argument("--parts", nargs="+", default=["base", "width", "depth"], choices=["base", "width", "depth"])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS, help="of the width part")
    p.add_argument("--steps", type=int, default=Proxy.steps, help="training steps per run")
    p.add_argument("--coord_check", action="store_true", help="the coordinate check instead of the sweep")
    p.add_argument("--coord_steps", type=int, default=4, help="coordinate check: the steps recorded")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.coord_check:
        tokens = compact_corpus(256)[0]
        found = {f"{check} {variant}": coordinate_check(coordinate_models(check, variant), tokens=tokens,
                                                        steps=args.coord_steps)
                 for check, variant in (("width", "standard"), ("width", "mup"), ("depth", "unscaled"),
                                        ("depth", "scaled"))}
        (out / "coord_check.json").write_text(json.dumps(found, indent=1))
        plot_coordinates(found, out / "coord_check.png")
    else:
        proxy = Proxy(steps=args.steps, warmup_steps=max(1, args.steps // 10))
        records = sweep(proxy, lines(args.parts, args.optimizers), out)
        text = tables(records)
        (out / "mup_transfer.md").write_text(text)
        plot(records, out / "mup_transfer.png")
        print(text)
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s (jax {jax.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
