"""Hugging Face GPT-2 weights in and out.

Our parameter names are GPT-2's own and our layouts are reshapes of HF's (`c_attn.weight` [D, 3·D] is our
`c_attn.kernel` [D, 3, H, K] read row-major), so the conversion is one table of names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from errors import CheckpointError, first_line
from gpt2.config import GPT2Config
from gpt2.model import GPT2
from gpt2.sharded_init import _resolve, abstract_model
from gpt2.sharding import ShardingRules, named_shardings

# Our path -> HF name. Block entries are relative to `h.{i}.` on the HF side.
TOP = {
    ("wte", "embedding"): "wte.weight",
    ("wpe", "embedding"): "wpe.weight",
    ("ln_f", "scale"): "ln_f.weight",
    ("ln_f", "bias"): "ln_f.bias",
}
BLOCK = {
    ("ln_1", "scale"): "ln_1.weight",
    ("ln_1", "bias"): "ln_1.bias",
    ("attn", "c_attn", "kernel"): "attn.c_attn.weight",
    ("attn", "c_attn", "bias"): "attn.c_attn.bias",
    ("attn", "c_proj", "kernel"): "attn.c_proj.weight",
    ("attn", "c_proj", "bias"): "attn.c_proj.bias",
    ("ln_2", "scale"): "ln_2.weight",
    ("ln_2", "bias"): "ln_2.bias",
    ("mlp", "c_fc", "kernel"): "mlp.c_fc.weight",
    ("mlp", "c_fc", "bias"): "mlp.c_fc.bias",
    ("mlp", "c_proj", "kernel"): "mlp.c_proj.weight",
    ("mlp", "c_proj", "bias"): "mlp.c_proj.bias",
}


HUB = "hub:"  # `hub:openai-community/gpt2` names a hub model; anything else is a local directory


class HFCheckpointError(CheckpointError):
    """A Hugging Face checkpoint cannot be read; the message names the file."""


def config_from_hf(hf: dict, **overrides) -> GPT2Config:
    """Our config from an HF `config.json` dict."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise HFCheckpointError(f"not a GPT-2 checkpoint: model_type={hf.get('model_type')!r}")
    try:
        fields = dict(
            vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
            n_head=hf["n_head"], n_embd=hf["n_embd"], layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        )
    except KeyError as e:
        raise HFCheckpointError(f"no {e.args[0]!r} in a GPT-2 config.json") from None
    return GPT2Config(**{**fields, **overrides})


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HFCheckpointError(f"{path}: not a readable Hugging Face config.json ({e})") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(f"{path}: not a readable Hugging Face config.json (not a JSON object)")
    return config


def from_hf(
    path_or_name: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules: ShardingRules | str = "fsdp",
    **config_overrides,
) -> GPT2:
    """Loads a Hugging Face GPT-2 (a local directory with config.json + *.safetensors, or a hub name).

    `config_overrides` set fields HF does not describe (scan_layers, dtype, pad_vocab_to, ...). With a
    mesh, every parameter is placed straight into its sharded layout.
    """
    directory = hf_directory(path_or_name)
    hf_config = read_hf_config(directory)
    try:
        config = config_from_hf(hf_config, **config_overrides)
    except HFCheckpointError as e:
        raise HFCheckpointError(f"{directory / 'config.json'}: {e}") from None
    tensors = _read_safetensors(directory)
    rules = _resolve(rules)
    graphdef, state = nnx.split(abstract_model(config, rules))
    shardings = dict(nnx.to_flat_state(named_shardings(state, mesh, rules))) if mesh else {}
    for path, var in nnx.to_flat_state(state):
        try:
            value = _gather(tensors, path, var.get_value(), config)
        except (KeyError, ValueError) as e:  # a missing tensor, or one of another shape than config.json says
            raise HFCheckpointError(f"{directory}: the safetensors do not match config.json ({e})") from None
        if shardings:
            var.set_value(jax.device_put(value, shardings[path].get_value()))
        else:
            var.set_value(jax.numpy.asarray(value))
    return nnx.merge(graphdef, state)


def to_hf(model: GPT2, out_dir: str | os.PathLike) -> Path:
    """Writes `config.json` + `model.safetensors` that `transformers.GPT2LMHeadModel.from_pretrained` loads."""
    from safetensors.numpy import save_file

    config = model.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(jax.device_get(var.get_value()), dtype=np.float32)
        for name, array in _scatter(path, value, config):
            tensors["transformer." + name] = np.ascontiguousarray(array)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_hf_config(config), indent=2))
    return out


# ---- helpers ---------------------------------------------------------------------------------


def hf_directory(path_or_name) -> Path:
    """The local directory of a checkpoint: `hub:NAME` is downloaded (where the network allows), anything else
    must be a directory holding config.json — so a local folder that happens to share a hub model's name (the
    `gpt2/` package in this repository) is never mistaken for one, nor the other way round."""
    text = str(path_or_name)
    if text.startswith(HUB):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(text[len(HUB):], allow_patterns=["config.json", "*.safetensors"]))
        except Exception as e:  # noqa: BLE001 - offline, unknown repo, ...
            raise HFCheckpointError(f"{text}: cannot download from the Hugging Face hub ({first_line(e)})"
                                    ) from None
    path = Path(path_or_name)
    if not (path / "config.json").is_file():
        what = "a directory without config.json" if path.is_dir() else "no such directory"
        raise HFCheckpointError(f"{path}: {what}; give a Hugging Face checkpoint directory, or {HUB}{text} for the"
                                " hub model of that name")
    return path


def _read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(f"{directory}: no *.safetensors files")
    tensors = {}
    for f in files:
        try:
            loaded = load_file(f)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
            raise HFCheckpointError(f"{f}: not a readable safetensors file ({first_line(e)})") from None
        for name, array in loaded.items():
            tensors[name.removeprefix("transformer.")] = array  # GPT2LMHeadModel vs GPT2Model naming
    return tensors


def _hf_name(path: tuple, config: GPT2Config) -> tuple[str, bool]:
    """(HF name, is a stacked/looped block parameter) for one of our flat paths."""
    if path in TOP:
        return TOP[path], False
    rest = path[1:] if config.scan_layers else path[2:]
    return BLOCK[rest], True


def _gather(tensors, path, abstract, config: GPT2Config) -> np.ndarray:
    name, in_block = _hf_name(path, config)
    if not in_block:
        value = tensors[name]
        if name == "wte.weight":  # pad rows for padded vocab ids (never predicted, masked in the head)
            value = np.pad(value, ((0, config.padded_vocab_size - value.shape[0]), (0, 0)))
        return value.reshape(abstract.shape).astype(abstract.dtype)
    if config.scan_layers:
        layers = [tensors[f"h.{i}.{name}"] for i in range(config.n_layer)]
        return np.stack(layers).reshape(abstract.shape).astype(abstract.dtype)
    return tensors[f"h.{path[1]}.{name}"].reshape(abstract.shape).astype(abstract.dtype)


def _scatter(path, value: np.ndarray, config: GPT2Config):
    """Yields (HF name, HF-shaped array) for one of our parameters."""
    name, in_block = _hf_name(path, config)
    if not in_block:
        if name == "wte.weight":
            value = value[: config.vocab_size]
        yield name, value
        return
    hf_shape = {"attn.c_attn.weight": (config.n_embd, 3 * config.n_embd),
                "attn.c_attn.bias": (3 * config.n_embd,),
                "attn.c_proj.weight": (config.n_embd, config.n_embd)}
    layers = enumerate(value) if config.scan_layers else [(path[1], value)]
    for i, layer in layers:
        yield f"h.{i}.{name}", layer.reshape(hf_shape.get(name, layer.shape))


def _hf_config(config: GPT2Config) -> dict:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        # GPT-2's <|endoftext|>; only meaningful when the vocabulary has it
        **({"bos_token_id": 50256, "eos_token_id": 50256} if config.vocab_size > 50256 else {}),
    }
