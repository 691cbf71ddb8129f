"""The GPT-2 BPE through tiktoken, from the rank file shipped in `data/assets` (no network needed)."""

from __future__ import annotations

import functools
from pathlib import Path

import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import r50k_pat_str

ASSETS = Path(__file__).parent / "assets"
RANKS_FILE = ASSETS / "r50k_base.tiktoken"
# tiktoken's own expected sha256 for r50k_base.tiktoken (GPT-2's `gpt2` encoding uses the same ranks)
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
TOKENIZER_NAME = "gpt2"
EOT = 50256  # <|endoftext|>
VOCAB_SIZE = 50257


@functools.cache
def get_tokenizer() -> tiktoken.Encoding:
    """GPT-2's encoding, built from the shipped ranks after checking their hash."""
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(RANKS_FILE), expected_hash=RANKS_SHA256)
    except ValueError as e:
        raise ValueError(f"{RANKS_FILE}: corrupt tokenizer file (sha256 is not {RANKS_SHA256})") from e
    enc = tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
    )
    assert enc.n_vocab == VOCAB_SIZE, enc.n_vocab
    return enc


def save_hf_tokenizer(out_dir, *, model_max_length: int) -> None:
    """Writes `tokenizer.json` + `tokenizer_config.json` that `transformers.AutoTokenizer` loads and that encode
    exactly as `get_tokenizer()` (tested on unicode, whitespace runs, code and <|endoftext|>).

    The BPE comes from the same hash-checked rank file through transformers' own `TikTokenConverter`. Its
    default split pattern is not GPT-2's (it encodes some whitespace and contractions differently), so
    tiktoken's r50k pattern is passed explicitly. Needs the `hf` extra.
    """
    from transformers import PreTrainedTokenizerFast  # the optional `hf` extra
    from transformers.convert_slow_tokenizer import TikTokenConverter

    get_tokenizer()  # checks the rank file's hash
    eot = "<|endoftext|>"
    bpe = TikTokenConverter(vocab_file=str(RANKS_FILE), pattern=r50k_pat_str, extra_special_tokens=[eot]).converted()
    assert bpe.token_to_id(eot) == EOT, bpe.token_to_id(eot)
    # GPT-2's own tokenizer uses <|endoftext|> as bos, eos and unk, and has no padding token
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot,
                                        model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(str(out_dir))
