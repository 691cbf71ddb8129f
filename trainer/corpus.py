"""Which corpus a run reads, and its training and validation pipelines (train.py and eval.py alike)."""

from __future__ import annotations

from pathlib import Path

import jax

from configs.base import Config, DataConfig
from data.loader import Corpus, LoaderConfig, make_dataset, open_corpus
from errors import ConfigError
from trainer.processes import on_process_0
from trainer.storage.files import is_remote

EMBEDDED = "shakespeare"


def resolve_corpus(data: DataConfig, *, vocab_size: int, seq_len: int, prepare: bool = True) -> Corpus:
    """The configured corpus, validated; the embedded one is tokenized on first use (by process 0, while the
    others wait for it)."""
    if is_remote(data.dataset):
        raise ConfigError(f"data.dataset={data.dataset!r}: token files are read from a local or mounted directory"
                          " (memory-mapped, random access); mount the bucket with gcsfuse and pass the mount's path"
                          " (docs/pods.md, Token files on a pod)")
    if data.dataset == EMBEDDED:
        directory = Path(data.cache_dir).expanduser()
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"data.cache_dir={data.cache_dir} is a file; the embedded corpus is tokenized into a"
                              " directory: pass a directory (it is made if missing), or a prepared corpus with"
                              " --data.dataset=DIR")
        if prepare:
            on_process_0(lambda: _prepare_embedded(directory, data.cache_dir),
                         f"prepare the embedded corpus in {directory}")
    else:
        directory = Path(data.dataset).expanduser()
    return open_corpus(directory, vocab_size=vocab_size, min_tokens=seq_len + 1)


def _prepare_embedded(directory: Path, given: str) -> None:
    from data.prepare import prepare_shakespeare  # the corpus writer: only for the embedded corpus

    try:
        prepare_shakespeare(directory, quiet=(directory / "meta.json").exists())
    except OSError as e:  # a directory the user cannot write to: a UserError, so every process ends with it
        raise ConfigError(f"data.cache_dir={given}: cannot tokenize the embedded corpus there ({e.strerror or e});"
                          " pass a directory you can write to") from e


def train_loader_config(cfg: Config) -> LoaderConfig:
    t = cfg.train
    return LoaderConfig(
        seq_len=t.seq_len, batch_size=t.batch_size // jax.process_count(), seed=cfg.data.seed,
        num_workers=cfg.data.num_workers, prefetch=cfg.data.prefetch,
    )


def val_dataset(corpus: Corpus, *, vocab_size: int, seq_len: int, batch_size: int,
                num_epochs: int | None = None, prefetch: int = 2):
    """Validation batches [B_local, T+1] in file order: every evaluation sees the same ones.
    num_epochs=None repeats the split (training's fixed-size evaluations); 1 ends after it (eval.py)."""
    loader = LoaderConfig(seq_len=seq_len, batch_size=batch_size // jax.process_count(), shuffle=False,
                          num_epochs=num_epochs, prefetch=prefetch)
    return make_dataset(corpus.files("val"), vocab_size, loader)
