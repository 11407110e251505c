"""GPT-2's byte-level BPE through the ``tokenizers`` library: tokenizer.json, or vocab.json + merges.txt.

``IncrementalDecoder`` turns a stream of token ids into text pieces, each token decoding a window of a
few tokens (O(1), not O(output)); a trailing U+FFFD (a multi-byte character split across tokens) is held
back until the next token completes it.
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
        check_text(text)
        return self._tok.encode(text).ids

    def encode_batch(self, texts) -> list[list[int]]:
        """Several texts, each as :meth:`encode` makes it; the library tokenizes them without holding the
        GIL (``encode`` holds it throughout: a server's event loop would wait for a long prompt)."""
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def check_text(text, what: str = "prompt") -> None:
    """A ValueError naming ``what`` unless ``text`` is Unicode text a UTF-8 tokenizer takes: a command-line
    argument that was not UTF-8 arrives with its bytes escaped as lone surrogates (U+DC80-U+DCFF)."""
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        why = (f"byte 0x{c - 0xDC00:02x} at character {e.start} is not UTF-8" if 0xDC80 <= c <= 0xDCFF else
               f"a lone surrogate U+{c:04X} at character {e.start}")
        raise ValueError(f"{what}: not valid Unicode text ({why}); pass UTF-8 text") from None


_REPL = "\ufffd"  # what a byte sequence that is not (yet) a character decodes to


class IncrementalDecoder:
    """Token ids in, text pieces out, O(1) amortized per token: each push decodes a window of a few
    tokens, not the whole output. The pieces are those of decoding the whole output after every token and
    emitting what is new, holding everything back while the text ends in U+FFFD (an incomplete multi-byte
    character, or bytes that are none, which stay U+FFFD until a real character follows).

    The window is ``ids[_prefix:]``: ``ids[_prefix:_read]`` decode to ``_prefix_text``, already emitted,
    and stay as left context (a tokenizer may decode a window's first token differently, as
    SentencePiece's leading space); its text past ``_prefix_text`` is the new text. Both offsets are
    character boundaries (the text there did not end in U+FFFD), so the window's text is the whole
    output's from there on. A run of U+FFFD longer than ``HOLD`` tokens is split off into ``_held``
    (still not emitted) so that the window stays short even then (see ``_split_held``)."""

    HOLD = 8  # tokens past _read before a held run is split off: > 3, the bytes an incomplete character keeps

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = self._read = 0
        self._prefix_text = ""
        self._held = ""         # text past ids[:_read] that is final but held back (a U+FFFD run)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._pieces)

    def push(self, token: int) -> str:
        """Append one token; return the new text it completes ('' while a character is incomplete)."""
        self.ids.append(int(token))
        window = self.tokenizer.decode(self.ids[self._prefix:])
        if window.endswith(_REPL):
            if len(self.ids) - self._read > self.HOLD:
                self._split_held(window)
            return ""
        return self._take(window)

    def flush(self) -> str:
        """The rest, a trailing incomplete character as U+FFFD (the end of the stream: tokens pushed after
        it decode on their own)."""
        piece = self._take(self.tokenizer.decode(self.ids[self._prefix:]))
        self._prefix = self._read
        self._prefix_text = ""
        return piece

    def _take(self, window: str) -> str:
        piece = self._held + window[len(self._prefix_text):]
        self._held = ""
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        if piece:
            self._pieces.append(piece)
        return piece

    def _split_held(self, window: str) -> None:
        """Move ``_read`` up to a token j near the end that is a character boundary, the text up to it
        into ``_held``. j is one if the window decoded in two parts at j gives the same text: a character
        or an invalid sequence spanning j would decode, in two parts, to U+FFFD on each side of j. A
        character spans at most 4 bytes, a token holds at least one: one of 4 consecutive j is one. A
        tokenizer for which no j passes (a context-dependent decode) keeps its longer window."""
        for j in range(len(self.ids) - 1, max(self._read, len(self.ids) - 5), -1):
            left = self.tokenizer.decode(self.ids[self._prefix:j])
            if left.startswith(self._prefix_text) and left + self.tokenizer.decode(self.ids[j:]) == window:
                self._held += left[len(self._prefix_text):]
                self._prefix, self._read = self._read, j
                self._prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
                return
