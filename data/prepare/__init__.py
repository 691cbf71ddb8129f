"""Corpus preparation, the writer of the files `data.loader` reads (their format: `data.format`).

    sources.py   read: the source's work units, each read as a stream of documents (decompressing)
    tokens.py    tokenize: each document's split, tiktoken on threads
    commit.py    the work area out_dir/.prepare: resume after a kill, workers sharing one out_dir
    shards.py    the final token files and meta.json, once every unit is committed
    pipeline.py  `prepare`: the stages in order for one worker; `prepare_shakespeare`, the default corpus
    config.py    `PrepareConfig`, the flags;  cli.py: `python -m data.prepare` (a program: import it from there)
"""

from data.prepare.config import PrepareConfig
from data.prepare.pipeline import SHAKESPEARE, prepare, prepare_shakespeare
from data.prepare.tokens import is_val
from errors import DataError  # public here too: callers catch it from data.prepare

__all__ = ["DataError", "PrepareConfig", "SHAKESPEARE", "is_val", "prepare", "prepare_shakespeare"]
