"""The sample a training run ends with: its prompt, checked before any work; its decoding, compiled ahead while the
run trains (trainer/program/ahead.py); its text."""

from __future__ import annotations

from typing import Callable

from configs.base import Config
from trainer.corpus import EMBEDDED
from trainer.eval.sampling import compile_sample_ahead, prompt_that_fits, sample
from trainer.program.train_program import TrainProgram

TOP_K = 200  # nanoGPT's sample.py
TEMPERATURE = 0.8


def prompt(cfg: Config) -> list[int]:
    """train.sample_prompt's ids, refused in one line when they do not fit; by default "ROMEO:" on the embedded
    corpus and <|endoftext|> on any other."""
    context, text = cfg.model.block_size, cfg.train.sample_prompt
    if text is None:  # "" starts from <|endoftext|>
        text = "ROMEO:" if cfg.data.dataset == EMBEDDED else ""
    return prompt_that_fits(text, context, prompt_flag="train.sample_prompt", context=f"model.block_size={context}")


class FinalSample:
    """train.sample_tokens tokens sampled from the trained model, if the run asks for them."""

    def __init__(self, cfg: Config, program: TrainProgram):
        self.cfg, self.program = cfg, program
        self.compiled: Callable | None = None

    @property
    def wanted(self) -> bool:
        """A sample is taken at the end of a run that reaches train.steps (not one stopped at train.stop_after)."""
        t = self.cfg.train
        return bool(t.sample_tokens) and (t.stop_after or t.steps) >= t.steps

    def compile_ahead(self) -> None:
        if self.wanted and self.compiled is None:
            self.compiled = compile_sample_ahead(self.program.layout, prompt(self.cfg), self.cfg.train.sample_tokens,
                                                 TOP_K)

    def text(self, state) -> str:
        """Every process must call it: the parameters may span them all."""
        t = self.cfg.train
        text = sample(self.program.model(state["params"]), prompt(self.cfg), t.sample_tokens, seed=t.seed,
                      temperature=TEMPERATURE, top_k=TOP_K, compiled=self.compiled)
        return f"--- sample ---\n{text}\n--------------"
