"""Character-level tokenizer for the built-in tasks (Countdown, Sudoku).

A real `transformers.PreTrainedTokenizerFast` built with `tokenizers`, so it is saved
and loaded beside the model with `save_pretrained` / `AutoTokenizer.from_pretrained`
and behaves like any other tokenizer for the rest of the library.

Every character is one token; the special tokens come first so their ids are stable:
PAD=0, MASK=1, BOS=2, EOS=3, UNK=4.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHARS", "SPECIAL_TOKENS", "build_char_tokenizer"]

SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "mask_token": "[MASK]",
    "bos_token": "[BOS]",
    "eos_token": "[EOS]",
    "unk_token": "[UNK]",
}
# Everything the built-in tasks write: digits, the four operations, parentheses, the
# separators of the prompts and '.' for an empty Sudoku cell.
CHARS = "0123456789+-*/()=,."


def build_char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with one token per character of `chars`."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in the tokenizer alphabet {chars!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for c in chars:
        vocab[c] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # Split every character into its own pre-token; Fuse joins them back without spaces.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Prompts are left-padded so that every completion starts at the same column.
    return PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", **SPECIAL_TOKENS)
