"""Single-request generation: sampling, stopping, streaming and timings on top of ``GPT2``.

``stream(...)`` returns a :class:`Generation`; iterating it runs the model and yields a
:class:`TokenEvent` per new token as soon as it is sampled (with the text it completes when a tokenizer
is given), and after the loop ``.result`` holds the tokens, the text, why it stopped and the timings.
``generate(...)`` runs a stream to the end and returns that result.

The KV cache is the paged layout the decode kernel reads, with the sequence's blocks taken in order
(block table = 0, 1, 2, ...; slot = position): the engine's block pool replaces that for many requests.

On a GPU with the triton backend, decode steps replay a CUDA graph of the whole step
(:class:`tritune.model.engine.DecodeGraphs` at batch 1: embedding, layers, logits, greedy argmax, and the
position advanced on the device), captured once per model and cache size. The host runs one step ahead:
step s+1 is queued before the token of step s is read back, so the GPU never waits for the host's
per-token work (streaming, stop checks). Sampled tokens are drawn on the device between two replays,
so a seeded generator gives the same tokens as the eager path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tritune.model.tokenizer import IncrementalDecoder

_DEFAULT = object()


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------
def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature: expected a number >= 0 (0 is greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p!r}")


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of ``logits`` (B, V) -> (B,) int64. temperature 0 is greedy (argmax).

    Top-k keeps the k largest logits; top-p then keeps the smallest set of most likely tokens whose
    probability reaches p (the most likely token always survives). Sampling draws from ``generator``, so
    a seeded generator gives the same tokens for the same logits.
    """
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------
@dataclass
class TokenEvent:
    token: int | None      # None for the final event that only flushes held-back text
    text: str = ""         # text completed by this token ('' without a tokenizer or while held back)


@dataclass
class Timings:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0    # prompt forward + first token sampled
    decode_s: float = 0.0      # the other new_tokens - 1 tokens

    @property
    def decode_tok_s(self) -> float:
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")

    def __str__(self) -> str:
        return (f"prefill {self.prefill_ms:.1f} ms ({self.prompt_tokens} tokens), "
                f"decode {max(0, self.new_tokens - 1)} tokens in {self.decode_s * 1e3:.1f} ms "
                f"({self.decode_tok_s:.1f} tok/s)")


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None   # "eos", "stop" (a stop string), "length" (max_new_tokens), "context"
    truncated: int = 0                 # prompt tokens dropped from the left
    timings: Timings = field(default_factory=Timings)


# ---------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------
def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


_MAX_DECODERS = 4     # cached decode graphs per model (one per cache size)


def _acquire_decoder(model, num_blocks: int, block_size: int):
    """The model's DecodeGraphs for a one-sequence cache of ``num_blocks`` blocks (built and captured on
    first use, then reused), or None while another generation holds it."""
    from tritune.model.engine import DecodeGraphs

    cache = model.__dict__.setdefault("_decoders", {})
    key = (num_blocks, block_size)
    dec = cache.get(key)
    if dec is None:
        if len(cache) >= _MAX_DECODERS:
            idle = [k for k, d in cache.items() if not d.busy]
            if not idle:
                return None
            del cache[idle[0]]
        kv = model.new_cache(num_blocks * block_size, block_size)
        dec = DecodeGraphs(model, model.ops, kv, num_blocks, [1], capture=graphs_available(model))
        dec.busy = False
        cache[key] = dec
    if dec.busy:
        return None
    dec.busy = True
    return dec


def graphs_available(model) -> bool:
    """Whether ``stream``/``generate`` replay CUDA graphs by default: the triton backend on a CUDA device
    with its decode kernels (write_kv skipping padding slots and paged attention)."""
    ops = model.ops
    return (torch.device(model.device).type == "cuda" and model.backend == "triton"
            and getattr(ops, "_paged", None) is not None)


class Generation:
    def __init__(self, model, prompt_ids, *, tokenizer, max_new_tokens, temperature, top_k, top_p, seed,
                 stop, eos_token_id, truncate, block_size, cuda_graph=None):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        check_sampling(temperature, top_k, top_p)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        if stops and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("prompt: empty (at least one token is needed)")
        n_pos = model.config.n_positions
        truncated = 0
        if truncate:
            keep = max(1, min(len(ids), n_pos - max_new_tokens + 1))
            truncated, ids = len(ids) - keep, ids[len(ids) - keep:]
        elif len(ids) > n_pos:
            raise ValueError(f"prompt: {len(ids)} tokens is longer than the model's context of {n_pos} "
                             f"(n_positions); shorten it or pass truncate=True to keep its last tokens")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed, self.stops, self.block_size = seed, stops, block_size
        self.eos = model.config.eos_token_id if eos_token_id is _DEFAULT else eos_token_id
        self.result = GenerationResult(prompt_ids=ids, truncated=truncated)
        self.cuda_graph = graphs_available(model) if cuda_graph is None else bool(cuda_graph)
        self._started = False

    def __iter__(self):
        if self._started:
            raise RuntimeError("a Generation runs once; call stream() again for another")
        self._started = True
        return self._run()

    def _run(self):
        P, n_pos = len(self.result.prompt_ids), self.model.config.n_positions
        # positions that get K/V: the prompt and every new token but the last (which is never fed back)
        need = min(n_pos, P + self.max_new_tokens - 1)
        dec = None
        if self.cuda_graph:
            dec = _acquire_decoder(self.model, max(1, -(-need // self.block_size)), self.block_size)
        try:
            yield from self._generate(dec, need)
        finally:
            if dec is not None:
                dec.busy = False

    def _generate(self, dec, need):
        model, res = self.model, self.result
        dev = model.device
        ids = res.prompt_ids
        P = len(ids)
        cache = dec.kv if dec is not None else model.new_cache(need, self.block_size)
        gen = None
        if self.seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(int(self.seed))
        self._dec = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._text, self._held = "", ""   # text emitted; text held back as a possible start of a stop string

        _sync(dev)
        t0 = time.perf_counter()
        logits = model.prefill(torch.tensor(ids, dtype=torch.long, device=dev), [P], kv_cache=cache,
                               slot_mapping=torch.arange(P, device=dev))
        tok = sample(logits, self.temperature, self.top_k, self.top_p, gen)
        token = int(tok[0])          # syncs: the prefill time includes the first token
        t1 = time.perf_counter()
        res.timings = Timings(prompt_tokens=P, prefill_ms=(t1 - t0) * 1e3)
        if dec is None:
            yield from self._eager_steps(cache, tok, token, gen)
        else:
            yield from self._graph_steps(dec, token, gen)
        _sync(dev)
        res.timings.decode_s = time.perf_counter() - t1
        if self._dec is not None and res.finish_reason != "stop":
            rest = self._held + self._dec.flush()
            if rest:
                self._text += rest
                yield TokenEvent(None, rest)
        res.text = self._text

    def _eager_steps(self, cache, tok, token, gen):
        model = self.model
        dev = model.device
        P = len(self.result.prompt_ids)
        block_table = torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None, :]
        pos = torch.full((1,), P, dtype=torch.long, device=dev)     # also the slot: blocks in order
        ctx = torch.full((1,), P + 1, dtype=torch.int32, device=dev)
        n = P
        while True:
            ev = self._accept(token, n)
            yield ev
            if self.result.finish_reason is not None:
                break
            logits = model.decode(tok.view(1), pos, cache, pos, block_table, ctx)
            tok = sample(logits, self.temperature, self.top_k, self.top_p, gen)
            token = int(tok[0])
            pos += 1
            ctx += 1
            n += 1

    def _graph_steps(self, dec, token, gen):
        """Decode steps as graph replays, one step ahead of the host (see the module docstring)."""
        P, n_pos = len(self.result.prompt_ids), self.model.config.n_positions
        S = min(self.max_new_tokens - 1, n_pos - P)     # decode steps that may be needed
        dec.load([token], [P], [P + S], [-1], [list(range(dec.mb))])
        cuda = dec.device.type == "cuda"
        bufs = [torch.zeros(1, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        greedy = self.temperature == 0
        launched = 0

        def launch():
            nonlocal launched
            launched += 1
            logits = dec.run(1, 1)
            if not greedy:          # drawn on the device; it replaces the argmax the graph fed back
                dec.ids[:1].copy_(sample(logits, self.temperature, self.top_k, self.top_p, gen))
            i = launched % 2
            bufs[i].copy_(dec.ids[:1], non_blocking=cuda)
            if cuda:
                events[i].record()

        if S >= 1:
            launch()
        yield self._accept(token, P)
        s = 0
        while self.result.finish_reason is None:
            s += 1
            if launched < min(s + 1, S):
                launch()            # step s+1 is queued before step s's token is waited for
            if cuda:
                events[s % 2].synchronize()
            token = int(bufs[s % 2][0])
            yield self._accept(token, P + s)

    def _accept(self, token: int, n: int) -> TokenEvent:
        """Take the new token (``n``: the position it would be fed back at): stop checks, streamed text."""
        res = self.result
        res.tokens.append(token)
        res.timings.new_tokens = len(res.tokens)
        if self.eos is not None and token == self.eos:
            res.finish_reason = "eos"
        piece = ""
        if self._dec is not None and res.finish_reason != "eos":
            text, held = self._text, self._held
            full = text + held + self._dec.push(token)  # everything produced; text is what was emitted
            hits = [i for i in (full.find(s) for s in self.stops) if i >= 0]
            if hits:
                piece, held = full[len(text):min(hits)], ""
                res.finish_reason = "stop"
            else:
                keep = min(self._held_len(full), len(full) - len(text))
                piece, held = full[len(text):len(full) - keep], full[len(full) - keep:]
            self._text, self._held = text + piece, held
        if res.finish_reason is None and len(res.tokens) >= self.max_new_tokens:
            res.finish_reason = "length"
        if res.finish_reason is None and n >= self.model.config.n_positions:
            res.finish_reason = "context"
        return TokenEvent(token, piece)

    def _held_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string (it might complete it)."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def stream(model, prompt, *, tokenizer=None, max_new_tokens: int = 64, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop=None, eos_token_id=_DEFAULT,
           truncate: bool = False, block_size: int = 16, cuda_graph: bool | None = None) -> Generation:
    """A generation to iterate: ``prompt`` is text (needs ``tokenizer``) or a list of token ids.

    Stops at ``eos_token_id`` (default: the config's; None never stops on it), at a ``stop`` string (the
    text ends before it), after ``max_new_tokens``, or when the context is full. A prompt longer than
    the context raises ValueError; ``truncate=True`` instead keeps its last tokens, as many as leave
    room for ``max_new_tokens``. ``cuda_graph``: replay the decode step as a graph, one step ahead of
    the host (default: where :func:`graphs_available`; True elsewhere runs the same device-side step
    eagerly, False the plain per-step loop).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer (or pass token ids)")
        prompt = tokenizer.encode(prompt)
    return Generation(model, prompt, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                      eos_token_id=eos_token_id, truncate=truncate, block_size=block_size,
                      cuda_graph=cuda_graph)


def generate(model, prompt, **kwargs) -> GenerationResult:
    g = stream(model, prompt, **kwargs)
    for _ in g:
        pass
    return g.result
