"""A word-level tokenizer written locally beside a tiny checkpoint, so servers can take text (no download).

Token ``i`` is the word ``w{i}`` for i >= 3; 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>`` (the tiny
checkpoints' pad, bos and eos ids). Text is split on whitespace; decoding joins with spaces.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def tiny_vocabulary(vocab_size: int) -> dict[str, int]:
    words = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    return words


def write_tiny_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """tokenizer.json + tokenizer_config.json for ``vocab_size`` ids, as transformers saves them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    core = Tokenizer(models.WordLevel(tiny_vocabulary(vocab_size), unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    pad, bos, eos = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=pad)
    tokenizer.save_pretrained(directory)
    return directory
