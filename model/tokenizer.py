"""GPT-2's byte-level BPE through the ``tokenizers`` library: tokenizer.json, or vocab.json + merges.txt.

``IncrementalDecoder`` turns a stream of token ids into text pieces: it decodes the whole output so far
and emits what is new, holding back a trailing U+FFFD (a multi-byte character split across tokens) until
the next token completes it.
"""
from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, tok):
        self._tok = tok

    @classmethod
    def from_dir(cls, directory) -> "Tokenizer":
        directory = Path(directory)
        tj, vocab, merges = directory / "tokenizer.json", directory / "vocab.json", directory / "merges.txt"
        if tj.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            return cls(HFTokenizer.from_file(str(tj)))
        if vocab.is_file() and merges.is_file():
            from tokenizers import ByteLevelBPETokenizer

            return cls(ByteLevelBPETokenizer(str(vocab), str(merges)))
        raise FileNotFoundError(f"{directory}: no tokenizer (expected tokenizer.json, or vocab.json and merges.txt)")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""          # the text emitted so far

    def push(self, token: int) -> str:
        """Append one token; return the new text it completes ('' while a character is incomplete)."""
        self.ids.append(int(token))
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        piece = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return piece

    def flush(self) -> str:
        full = self.tokenizer.decode(self.ids)
        piece = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full
        return piece
