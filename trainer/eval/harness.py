"""lm-evaluation-harness tasks scored by our model, on any mesh: `eval.py --tasks hellaswag,lambada_openai`.

`GPT2LM` subclasses lm-eval's `TemplateLM`, so the request encoding is lm-eval's own (the context /
continuation split, the trailing-space move, <|endoftext|> before an empty context; the rolling windows of
`get_rolling_token_windows`, the stop sequences of `handle_stop_sequences`); this file only scores token rows.

Fixed shapes: the rows of one kind of request are sorted by length, cut into batches of `batch_size` rows
(the last one padded with empty rows) and right-padded to the next of a few lengths, `buckets(max_length)`:
64, 128, 256, ... and `max_length` itself — 5 shapes at a context of 1024, whatever the tasks. A causal model
never looks right, so padding changes no score. One jitted call (`score`) gives each position's
log-probability of its target and its greedy id; `generate_until` reuses it with greedy ids, recomputing the
row at every new token (no KV cache: the shapes stay fixed). Every process runs the same batches (SPMD) and
gets the figures back replicated. Needs the `eval` extra (`lm_eval[hf]`).
"""

from __future__ import annotations

import difflib
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from data.tokenizer import EOT, get_tokenizer
from errors import CheckpointError, ConfigError, first_line
from gpt2.hf import hub_offline
from trainer.processes import say
from trainer.program.evaluator import Evaluator
from trainer.storage.run_dir import eval_record

SHORTEST = 64  # the smallest padded length
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generate_until


def buckets(max_length: int) -> list[int]:
    """The padded row lengths: powers of two from SHORTEST below max_length, and max_length."""
    lengths = [SHORTEST * 2**i for i in range(max(0, math.ceil(math.log2(max_length / SHORTEST))))]
    return [n for n in lengths if n < max_length] + [max_length]


@functools.partial(jax.jit, static_argnums=0, out_shardings=(PartitionSpec(), PartitionSpec()))
def score(graphdef: nnx.GraphDef, params: nnx.State, inputs: jax.Array, targets: jax.Array):
    """(log p(targets) [B, T] float32, greedy ids [B, T] int32) for [B, T] inputs and targets, replicated on every
    device of the current mesh. One executable per model, mesh and padded shape: `eval.py --all` reuses it for
    every checkpoint."""
    logits = nnx.merge(graphdef, params)(inputs).astype(jnp.float32)  # [B, T, V]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    return target_logit - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1).astype(jnp.int32)


class GPT2LM(TemplateLM):
    """lm-eval's model interface over a GPT-2 of ours.

    Args:
      evaluator: the model's structure, mesh and shardings (trainer/program/evaluator.py).
      params: the parameters, in the evaluator's shardings.
      batch_size: rows per call (divisible by the mesh's data-parallel size).
      max_length: the longest row (at most the model's context); longer requests are cut on the left, as
        lm-eval's `hf` backend does.
    """

    def __init__(self, evaluator: Evaluator, params: nnx.State, *, batch_size: int, max_length: int):
        super().__init__()
        self.evaluator, self.params = evaluator, params
        self.batch_size, self._max_length = batch_size, max_length
        self.lengths = buckets(max_length)
        self.encoding = get_tokenizer()

    @property
    def eot_token_id(self) -> int:
        return EOT

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # as the exported HF tokenizer (and GPT-2's own) encodes: "<|endoftext|>" in the text is the token
        return self.encoding.encode(string, allowed_special="all")

    def tok_decode(self, tokens: list[int]) -> str:
        return self.encoding.decode(tokens)

    # ---- the three kinds of request -------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per request
        ((strings or None, context ids, continuation ids))."""
        rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
        scored = self._score_rows(rows, "loglikelihood", disable_tqdm)
        out = []
        for (strings, _, continuation), (logprobs, greedy) in zip(requests, scored):
            n = len(continuation)
            answer = (float(logprobs[-n:].sum()), bool(greedy[-n:].all()))
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents, in lm-eval's disjoint windows of max_length tokens."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (or <|endoftext|>)."""
        eos = self.tok_decode([EOT])
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample"):
                raise ConfigError(f"a task asks for sampled generation ({gen_kwargs}); this backend decodes greedily"
                                  " only")
            until, new = handle_stop_sequences(kwargs.get("until"), eos=eos), kwargs["max_gen_toks"]
            if new >= self.max_length:
                raise ConfigError(f"a task asks for {new} new tokens; the context is {self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - new):] or [self.prefix_token_id]  # "" -> <|endoftext|>
            jobs.append((ids, until, new))
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][0]))
        out = [""] * len(jobs)
        bar = tqdm(total=len(jobs), desc="generate_until", disable=disable_tqdm or jax.process_index() != 0)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            for i, text in zip(batch, self._generate([jobs[i] for i in batch])):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(len(batch))
        bar.close()
        return out

    # ---- fixed-shape calls ----------------------------------------------------------------------

    def _score_rows(self, rows: list[list[int]], kind: str, disable_tqdm: bool):
        """For each row of ids (≤ max_length + 1): (log p(row[t + 1] | row[:t + 1]), whether that is the greedy id)
        for every t, longest rows first in batches of batch_size, each padded to its bucket."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = [None] * len(rows)
        bar = tqdm(total=len(rows), desc=kind, disable=disable_tqdm or jax.process_index() != 0)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = self._bucket(len(rows[batch[0]]) - 1)
            inputs = np.zeros((self.batch_size, width), np.int32)
            targets = np.zeros_like(inputs)
            for r, i in enumerate(batch):
                n = len(rows[i]) - 1
                inputs[r, :n], targets[r, :n] = rows[i][:-1], rows[i][1:]
            logprobs, greedy = self._call(inputs, targets)
            for r, i in enumerate(batch):
                n = len(rows[i]) - 1
                out[i] = logprobs[r, :n], greedy[r, :n] == targets[r, :n]
            if not np.isfinite(logprobs).all():
                raise CheckpointError("lm-eval: the model's log-probabilities are not finite (the parameters are"
                                      " not finite)")
            bar.update(len(batch))
        bar.close()
        return out

    def _generate(self, jobs: list[tuple[list[int], list[str], int]]) -> list[str]:
        """Greedy decoding of up to batch_size (context ids, stop sequences, max new tokens) jobs at once."""
        width = self._bucket(max(len(context) + new for context, _, new in jobs))
        tokens = np.zeros((self.batch_size, width), np.int32)
        lengths = np.ones(self.batch_size, np.int64)  # empty rows: one pad token, never read
        for r, (context, _, _) in enumerate(jobs):
            tokens[r, :len(context)], lengths[r] = context, len(context)
        generated = [[] for _ in jobs]
        active = set(range(len(jobs)))
        while active:
            _, greedy = self._call(tokens, tokens)
            for r in list(active):
                context, until, new = jobs[r]
                token = int(greedy[r, lengths[r] - 1])
                generated[r].append(token)
                tokens[r, lengths[r]] = token
                lengths[r] += 1
                if len(generated[r]) >= new or any(stop in self.tok_decode(generated[r]) for stop in until):
                    active.discard(r)
        return [postprocess_generated_text(self.tok_decode(ids), until, None)
                for ids, (_, until, _) in zip(generated, jobs)]

    def _bucket(self, length: int) -> int:
        return next(n for n in self.lengths if n >= length)

    def _call(self, inputs: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sharding, layout = self.evaluator.batch_sharding, self.evaluator.layout
        put = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])  # noqa: E731
        with jax.set_mesh(layout.mesh):
            logprobs, greedy = score(layout.graphdef, self.params, put(inputs), put(targets))
        return np.asarray(logprobs), np.asarray(greedy)


# ---- tasks -------------------------------------------------------------------------------------


def task_names(tasks: str) -> list[str]:
    return [name.strip() for name in tasks.split(",") if name.strip()]


@functools.cache
def _indexed_tasks(include_path: str | None, include_defaults: bool):
    """One index per process of a folder of task files (the check before the run and every evaluation share it)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def task_manager(tasks: str, include_path: str | None, flags: tuple[str, str] = ("--tasks", "--include_path")):
    """lm-eval's TaskManager, checked to know every task in `tasks`. Tasks found under `include_path` need no
    index of lm-eval's ~15,000 built-in task files (7 s). `flags`: the two settings' names, for the errors."""
    names, (tasks_flag, include_flag) = task_names(tasks), flags
    if not names:
        raise ConfigError(f"{tasks_flag} {tasks!r} names no task")
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ConfigError(f"{include_flag} {include_path}: no such directory")
        local = _indexed_tasks(include_path, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = _indexed_tasks(include_path, include_defaults=True)
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"{tasks_flag}: no lm-eval task {name!r}{hint}; `lm-eval ls tasks` lists them,"
                              f" {include_flag} adds a directory of task YAMLs")
    return manager


def check_tasks_load(tasks: str, include_path: str | None, flags: tuple[str, str]) -> None:
    """Every task known and its documents loadable now (a hub dataset with no network fails here, before any
    work, not at the first evaluation); the datasets library keeps what it loaded for the evaluations."""
    manager = task_manager(tasks, include_path, flags)
    offline_without_hub()
    try:
        manager.load(task_names(tasks))
    except Exception as e:  # noqa: BLE001 - datasets and the hub raise many kinds; the reason is the line
        raise ConfigError(f"{flags[0]}: cannot load the tasks' documents ({first_line(e)}); with no network, give"
                          f" local task YAMLs in {flags[1]}") from None


def offline_without_hub(timeout: float = 3.0) -> None:
    """The hub's offline mode (gpt2/hf.py `hub_offline`) for the datasets library too: a dataset in the cache
    still loads and a missing one fails at once. Asked once, at the check."""
    import datasets

    if hub_offline(timeout):
        datasets.config.HF_HUB_OFFLINE = True


def evaluate_tasks(evaluator: Evaluator, params, *, tasks: str, include_path: str | None, limit: int | None,
                   batch_size: int, max_length: int, table: bool = True, **key) -> dict:
    """One eval.json record: lm-eval's figures for `tasks`, keyed by the step (or model) and the settings
    that change them (tasks, limit, max_length)."""
    import lm_eval
    from lm_eval.utils import make_table

    lm = GPT2LM(evaluator, params, batch_size=batch_size, max_length=max_length)
    out = lm_eval.simple_evaluate(model=lm, tasks=task_names(tasks), limit=limit, log_samples=False,
                                  task_manager=task_manager(tasks, include_path))
    settings = {**key, "tasks": ",".join(task_names(tasks)), "limit": limit or "all", "max_length": max_length}
    figures = {task: {name.removesuffix(",none"): value for name, value in metrics.items()
                      if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "sample_len"}
               for task, metrics in out["results"].items()}
    record = eval_record(settings, lm_eval=figures, lm_eval_version=lm_eval.__version__,
                         documents={task: n["effective"] for task, n in out["n-samples"].items()})
    if table:
        where = f"step {key['step']}" if key.get("step") is not None else "model"
        say(f"{where}: lm-eval {settings['tasks']} (max_length {max_length}, limit {settings['limit']})\n"
            f"{make_table(out)}")
    return record
