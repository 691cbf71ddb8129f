"""Hugging Face GPT-2 weights in and out.

Our parameter names are GPT-2's own and our layouts are reshapes of HF's (`c_attn.weight` [D, 3·D] is our
`c_attn.kernel` [D, 3, H, K] read row-major), so the conversion is one table of names. Import reads each
device's shard from the memory-mapped files by itself: on a pod, a host reads only what its devices hold.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import urllib.parse
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from huggingface_hub import constants, snapshot_download
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

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


def require_standard(config: GPT2Config, what: str) -> None:
    """Hugging Face's GPT-2 is the standard parametrization: a μP model's multipliers have no place in it, and its
    weights mean something else under them."""
    if config.parametrization != "standard":
        raise HFCheckpointError(f"{what}: model.parametrization={config.parametrization}; Hugging Face's GPT-2 has no"
                                " μP multipliers (embeddings × α_in, logits × α_out/m, attention √K_base/K, branches"
                                " × L_base/L): only standard models convert")


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
    require_standard(config, str(directory))
    files = SafetensorsFiles(directory)
    rules = _resolve(rules)
    graphdef, state = nnx.split(abstract_model(config, rules))
    shardings = dict(nnx.to_flat_state(named_shardings(state, mesh, rules))) if mesh else {}
    for path, var in nnx.to_flat_state(state):
        abstract, stacked = var.get_value(), config.scan_layers and _hf_name(path, config)[1]
        tensors = _hf_tensors(path, abstract.shape, config)
        try:
            files.check(tensors)
            region = _RegionReader(files, tensors, abstract, stacked)
        except (KeyError, ValueError) as e:  # a missing tensor, or one of another shape than config.json says
            raise HFCheckpointError(f"{directory}: the safetensors do not match config.json ({e})") from None
        if shardings:  # each device's shard is read from the files by itself: a host reads only its own
            var.set_value(jax.make_array_from_callback(abstract.shape, shardings[path].get_value(), region))
        else:
            var.set_value(jax.numpy.asarray(region(tuple(slice(None) for _ in abstract.shape))))
    return nnx.merge(graphdef, state)


def to_hf(model: GPT2, out_dir: str | os.PathLike) -> Path:
    """Writes `config.json` + `model.safetensors` that `transformers.GPT2LMHeadModel.from_pretrained` loads."""
    config = model.config
    require_standard(config, str(out_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(jax.device_get(var.get_value()), dtype=np.float32)
        for name, array in _scatter(path, value, config):
            tensors["transformer." + name] = np.ascontiguousarray(array)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    # safetensors writes through a private temporary file (mode 0600): give it the mode any file written here gets
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(out / "model.safetensors", 0o666 & ~mask)
    (out / "config.json").write_text(json.dumps(_hf_config(config), indent=2))
    return out


# ---- helpers ---------------------------------------------------------------------------------


def hf_directory(path_or_name) -> Path:
    """The local directory of a checkpoint: `hub:NAME` is downloaded (where the network allows), anything else
    must be a directory holding config.json — so a local folder that happens to share a hub model's name (the
    `gpt2/` package in this repository) is never mistaken for one, nor the other way round."""
    text = str(path_or_name)
    if text.startswith(HUB):
        hub_offline()  # no network: the local cache at once (a model not in it fails at once)
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


def hub_offline(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub library is offline in this process: as set (HF_HUB_OFFLINE=1), or made so now
    when the hub does not take a connection within `timeout` seconds. With no network it would retry every file for
    ~25 s before failing; offline, what the local cache holds loads and the rest fails at once."""
    if constants.HF_HUB_OFFLINE:
        return True
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return False
    except OSError:  # no route, no name resolution, or no answer
        constants.HF_HUB_OFFLINE = True
        return True


class SafetensorsFiles:
    """The tensors of a checkpoint directory's *.safetensors files, read by regions: the files are
    memory-mapped, so reading a region costs its own bytes, not the file's."""

    bytes_read = 0  # by every instance in this process: what a load cost (benchmarks/init_from.py reports it)

    def __init__(self, directory: Path):
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise HFCheckpointError(f"{directory}: no *.safetensors files")
        self.files, self.tensors = [], {}
        for path in paths:
            try:
                handle = safe_open(path, framework="numpy")
                for name in handle.keys():  # GPT2LMHeadModel ("transformer.h.0...") vs GPT2Model naming
                    self.tensors[name.removeprefix("transformer.")] = (path, handle.get_slice(name))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
                raise HFCheckpointError(f"{path}: not a readable safetensors file ({first_line(e)})") from None
            self.files.append(handle)  # the memory map lives as long as its handle

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raises KeyError for a missing tensor, ValueError for one of another shape."""
        for name, shape in expected.items():
            found = tuple(self.tensors[name][1].get_shape())
            if found != shape:
                raise ValueError(f"{name} has shape {found}, config.json implies {shape}")

    def read(self, name: str, box: tuple[slice, ...]) -> np.ndarray:
        path, tensor = self.tensors[name]
        try:
            region = tensor[box]
        except Exception as e:  # noqa: BLE001 - a file cut short after its header was read
            raise HFCheckpointError(f"{path}: {name} cannot be read ({first_line(e)})") from None
        SafetensorsFiles.bytes_read += region.nbytes
        return region


class _RegionReader:
    """Reads any region of one of our parameters from the HF tensors it is made of: a layer of a scanned
    stack is one HF tensor, and our dims regroup HF's row-major (`c_attn` [D, 3·D] is our [D, 3, H, K])."""

    def __init__(self, files: SafetensorsFiles, tensors: dict[str, tuple[int, ...]], abstract, stacked: bool):
        self.files, self.names, self.shape, self.dtype = files, list(tensors), abstract.shape, abstract.dtype
        self.stacked = stacked  # dim 0 counts layers, one HF tensor each
        layer_shape = self.shape[1:] if stacked else self.shape
        hf_shape = tensors[self.names[0]]
        self.stored_rows = hf_shape[0] if self.names[0] == "wte.weight" else None  # ours past it: padding
        self.groups = _groups(layer_shape, (layer_shape[0], *hf_shape[1:]) if self.stored_rows else hf_shape)
        self.seen: dict[tuple, np.ndarray] = {}  # the devices holding the same region read it once

    def __call__(self, index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in self.seen:
            if self.stacked:
                layers = range(self.shape[0])[index[0]]
                out = np.empty([len(range(n)[s]) for n, s in zip(self.shape, index)], self.dtype)
                for i, layer in enumerate(layers):
                    out[i] = self.layer(self.names[layer], index[1:])
                self.seen[key] = out
            else:
                self.seen[key] = self.layer(self.names[0], index)
        return self.seen[key]

    def layer(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The region `index` of one HF tensor, in our (per-layer) shape: read as boxes of consecutive HF rows
        and columns (a head-sharded `c_attn` is three column runs: its q, k and v parts)."""
        shape = self.shape[1:] if self.stacked else self.shape
        picks = [_hf_indices(shape, dims, index) for dims in self.groups]
        out = np.zeros([len(p) for p in picks], self.dtype)
        for runs in itertools.product(*(_runs(p) for p in picks)):
            box = [slice(start, stop) for start, stop, _ in runs]
            if self.stored_rows is not None:  # padded vocabulary rows stay zero
                box[0] = slice(box[0].start, min(box[0].stop, self.stored_rows))
                if box[0].stop <= box[0].start:
                    continue
            at = tuple(slice(offset, offset + b.stop - b.start) for (_, _, offset), b in zip(runs, box))
            out[at] = self.files.read(name, tuple(box))
        return out.reshape([len(range(n)[s]) for n, s in zip(shape, index)])


def _groups(ours: tuple[int, ...], hf: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Which of our consecutive dims make up each HF dim (our shape is HF's, reshaped row-major)."""
    groups, dim = [], 0
    for size in hf:
        start, product = dim, 1
        while dim < len(ours) and (product < size or dim == start):
            product *= ours[dim]
            dim += 1
        if product != size:
            raise ValueError(f"shape {ours} is not a regrouping of {hf}")
        groups.append(tuple(range(start, dim)))
    if dim != len(ours):
        raise ValueError(f"shape {ours} is not a regrouping of {hf}")
    return groups


def _hf_indices(ours: tuple[int, ...], dims: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """The indices along one HF dim that `index` selects in our `dims` making it up (ascending: row-major)."""
    sizes = [ours[d] for d in dims]
    return np.arange(int(np.prod(sizes))).reshape(sizes)[tuple(index[d] for d in dims)].ravel()


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Ascending indices as runs of consecutive ones: (start, stop, offset of the run in `ids`)."""
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return [(int(ids[a]), int(ids[b - 1]) + 1, int(a)) for a, b in zip([0, *breaks], [*breaks, len(ids)])]


def _hf_tensors(path: tuple, shape: tuple[int, ...], config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """The HF tensors one of our parameters is made of (one per layer of a scanned stack), with their shapes."""
    name, in_block = _hf_name(path, config)
    if not in_block:
        return {name: _hf_shape(name, shape, config)}
    if config.scan_layers:
        return {f"h.{i}.{name}": _hf_shape(name, shape[1:], config) for i in range(config.n_layer)}
    return {f"h.{path[1]}.{name}": _hf_shape(name, shape, config)}


def _hf_shape(name: str, ours: tuple[int, ...], config: GPT2Config) -> tuple[int, ...]:
    """The shape of the HF tensor `name` (`h.{i}.` left out) that our (per-layer) shape `ours` regroups."""
    d = config.n_embd
    return {"wte.weight": (config.vocab_size, d), "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
            "attn.c_proj.weight": (d, d)}.get(name, tuple(ours))


def _hf_name(path: tuple, config: GPT2Config) -> tuple[str, bool]:
    """(HF name, is a stacked/looped block parameter) for one of our flat paths."""
    if path in TOP:
        return TOP[path], False
    rest = path[1:] if config.scan_layers else path[2:]
    return BLOCK[rest], True


def _scatter(path, value: np.ndarray, config: GPT2Config):
    """Yields (HF name, HF-shaped array) for one of our parameters."""
    name, in_block = _hf_name(path, config)
    if not in_block:
        if name == "wte.weight":
            value = value[: config.vocab_size]
        yield name, value
        return
    layers = enumerate(value) if config.scan_layers else [(path[1], value)]
    for i, layer in layers:
        yield f"h.{i}.{name}", layer.reshape(_hf_shape(name, layer.shape, config))


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
