"""A run starts its loader's worker processes while its first program compiles, not at the first call's batches."""

import multiprocessing
import time
from types import SimpleNamespace

from data.loader import LoaderConfig, make_dataset, open_corpus
from trainer.run.context import RunContext


def test_the_workers_start_before_the_first_batch_is_asked_for(shakespeare):
    files = open_corpus(shakespeare, vocab_size=50257, min_tokens=65).files("train")
    loader = iter(make_dataset(files, 50257, LoaderConfig(seq_len=64, batch_size=8, num_workers=1)))
    before = set(multiprocessing.active_children())
    try:
        RunContext.start_loader(SimpleNamespace(train_iter=loader))
        started = time.monotonic()
        while len(set(multiprocessing.active_children()) - before) < 1 and time.monotonic() - started < 60:
            time.sleep(0.1)  # they start in the background
        assert len(set(multiprocessing.active_children()) - before) == 1  # and nothing has been read yet
        assert next(loader).shape == (8, 65)
    finally:
        loader.close()
