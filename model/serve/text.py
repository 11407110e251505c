"""Text out of a stream of token ids: incremental detokenization and stop strings, per choice."""
from __future__ import annotations


class TextOut:
    """One choice's text as its tokens arrive: drops EOS; cuts at the first stop string, holding back any
    tail that could begin one. Decodes a window of tokens that grows to WINDOW and then restarts a few
    tokens back (context for tokenizers whose first token decodes differently), so a token costs O(1),
    not O(length), and a delivery costs one decode: the text of the window decoded last time is its
    emitted prefix (a window ending in an incomplete character is not taken until it completes)."""

    WINDOW, CONTEXT = 64, 4

    def __init__(self, tokenizer, stops=(), eos: int | None = None):
        self.tok, self.stops, self.eos = tokenizer, tuple(stops), eos
        self.ids: list[int] = []
        self.prefix = 0         # the window: ids[prefix:]
        self.done = 0           # characters of the window's text already taken
        self.pending = ""
        self.stopped = False

    def feed(self, tokens) -> str:
        if self.stopped:
            return ""
        if self.eos is not None and self.eos in tokens:
            tokens = tokens[:tokens.index(self.eos)]
        if not tokens:
            return ""
        self.ids.extend(tokens)
        return self._emit(self._piece(final=False), final=False)

    def finish(self) -> str:
        """The rest at the end (a trailing incomplete character included, as the replacement char)."""
        return "" if self.stopped else self._emit(self._piece(final=True), final=True)

    def _piece(self, final: bool) -> str:
        full = self.tok.decode(self.ids[self.prefix:])
        if len(full) <= self.done or (full.endswith("\ufffd") and not final):
            return ""
        piece, self.done = full[self.done:], len(full)
        if len(self.ids) - self.prefix > self.WINDOW:     # restart the window a few tokens back
            self.prefix = len(self.ids) - self.CONTEXT
            self.done = len(self.tok.decode(self.ids[self.prefix:]))
        return piece

    def _emit(self, piece: str, final: bool) -> str:
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        keep = 0 if final else max((k for s in self.stops for k in range(1, min(len(s), len(self.pending) + 1))
                                    if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out
