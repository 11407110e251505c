"""One request at a time, through the serving engine at batch 1: streamed text, stop strings, timings.

``stream(model, prompt, ...)`` returns a :class:`Generation`; iterating it runs the engine and yields a
:class:`TokenEvent` per new token as soon as the engine hands it over (with the text it completes when a
tokenizer is given: text that may begin a stop string is held back until it cannot), and after the loop
``.result`` holds the tokens, the text, why it stopped and the timings. ``generate(...)`` runs a stream
to the end and returns that result. There is no second decode loop here: the tokens come from
:class:`~tritune.model.engine.engine.Engine` (one per model, block size, decode path and tokenizer, built on
first use and kept while the model lives), with its CUDA graphs of the decode step where the model can
use them (decoding then runs up to ``decode_steps`` steps per host sync, sampled tokens drawn on the
device between steps). That engine runs ahead (``Engine(run_ahead=True)``): while the caller streams,
detokenizes and prints one batch of tokens, the device already computes the next. Its batches are the
engine's longest (``decode_steps=GENERATE_DECODE_STEPS``): between two batches the device waits while the
host lands one batch and queues the next (~0.15 ms on an H100), which at 16 steps a batch cost the packaged
model's batch-1 decode (~0.13 ms a token) 5-7%; at 64 it is under 2%, and 64 tokens still stream within ~10 ms.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from tritune.model.engine import contract
from tritune.model.engine.engine import Engine
from tritune.model.engine.sampling import check_sampling, sample  # noqa: F401  (re-exported)
from tritune.model.engine.scheduler import SamplingParams
from tritune.model.tokenizer import IncrementalDecoder

_DEFAULT = object()
GENERATE_DECODE_STEPS = 64      # decode steps per host round trip of the batch-1 engine (the module docstring)


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
    finish_reason: str | None = None   # "eos", "stop" (a stop string), "length" (max_new_tokens)
    truncated: int = 0                 # prompt tokens dropped from the left
    timings: Timings = field(default_factory=Timings)


# ---------------------------------------------------------------------------------------------------
# The batch-1 engine of a model
# ---------------------------------------------------------------------------------------------------
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def graphs_available(model) -> bool:
    """Whether ``stream``/``generate`` capture the decode step as CUDA graphs by default: the triton
    backend on a CUDA device with kernels for the whole decode step (``ops.capturable``)."""
    return (torch.device(model.device).type == "cuda" and model.backend == "triton"
            and bool(getattr(model.ops, "capturable", False)))


def engine_for(model, *, block_size: int = 16, cuda_graph: bool | None = None, tokenizer=None,
               speculative=None, kv_cache_dtype=None) -> Engine:
    """The batch-1 engine ``stream`` runs ``model`` on (built on first use). ``cuda_graph``: None captures
    the decode step where :func:`graphs_available`; True does, or elsewhere runs the same device-side step
    without capture; False runs a plain forward per step. ``speculative``: as :class:`Engine`'s ("draft":
    the checkpoint's packaged draft, "ngram", or a proposer)."""
    if cuda_graph is None:
        mode = graphs_available(model)
    else:
        mode = (True if graphs_available(model) else "eager") if cuda_graph else False
    per_model = _ENGINES.setdefault(model, {})
    key = (block_size, mode, tokenizer, speculative, kv_cache_dtype)
    eng = per_model.get(key)
    if eng is None:
        eng = Engine(model, num_blocks=-(-model.max_context // block_size), block_size=block_size,
                     speculative=speculative,
                     max_num_seqs=1, cuda_graphs=mode, tokenizer=tokenizer, run_ahead=True,
                     decode_steps=GENERATE_DECODE_STEPS, kv_cache_dtype=kv_cache_dtype)
        per_model[key] = eng
    return eng


def _drop(engine, req) -> None:
    if not req.finished:
        engine.abort(req.id)


# ---------------------------------------------------------------------------------------------------
# A generation
# ---------------------------------------------------------------------------------------------------
class Generation:
    """One request queued on the model's batch-1 engine; iterate it (once) for its tokens."""

    def __init__(self, model, prompt_ids, *, tokenizer, max_new_tokens, temperature, top_k, top_p, seed,
                 stop, eos_token_id, truncate, block_size, cuda_graph=None, speculative=None, kv_cache_dtype=None):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        check_sampling(temperature, top_k, top_p)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        if stops and tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        eos = model.eos_token_id if eos_token_id is _DEFAULT else eos_token_id
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed, stop=tuple(stops), ignore_eos=eos_token_id is not _DEFAULT,
                                  stop_token_ids=() if eos_token_id is _DEFAULT or eos is None else (eos,))
        self.engine = engine_for(model, block_size=block_size, cuda_graph=cuda_graph, tokenizer=tokenizer,
                                 speculative=speculative, kv_cache_dtype=kv_cache_dtype)
        self.tokenizer, self.stops, self.eos = tokenizer, stops, eos
        # the ids that end it: all of the model's (Llama-3 lists several), or the one given
        self.eos_ids = frozenset(contract.eos_ids(model) if eos_token_id is _DEFAULT else () if eos is None else (eos,))
        self.max_new_tokens = max_new_tokens
        self._tokens = self.engine.stream(prompt_ids, sampling, truncate=truncate)
        self.request = req = self._tokens.request
        # a generation dropped before it ran must not hold the engine's seat
        weakref.finalize(self, _drop, self.engine, req)
        self.result = GenerationResult(prompt_ids=list(req.prompt_ids), truncated=req.truncated)
        self._started = False

    def __iter__(self):
        if self._started:
            raise RuntimeError("a Generation runs once; call stream() again for another")
        self._started = True
        return self._run()

    def close(self) -> None:
        """Drop the request (its tokens so far stay in ``result``)."""
        _drop(self.engine, self.request)

    def _run(self):
        res, dev = self.result, self.engine.device
        self._dec = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._text, self._held = "", ""   # text emitted; text held back as a possible start of a stop string
        res.timings = Timings(prompt_tokens=len(res.prompt_ids))
        try:
            _sync(dev)
            t0 = time.perf_counter()
            t1 = None
            for token in self._tokens:
                if t1 is None:
                    t1 = time.perf_counter()
                    res.timings.prefill_ms = (t1 - t0) * 1e3
                yield self._accept(token)
                if res.finish_reason is not None:
                    break
            _sync(dev)
            res.timings.decode_s = time.perf_counter() - t1
        finally:
            self.close()
        if res.finish_reason is None:       # the engine ended it first (a stop string it saw on the text)
            res.finish_reason = self.request.finish_reason
        if self._dec is not None and res.finish_reason != "stop":
            rest = self._held + self._dec.flush()
            if rest:
                self._text += rest
                yield TokenEvent(None, rest)
        res.text = self._text

    def _accept(self, token: int) -> TokenEvent:
        """Take the new token: the same stop rules as the engine's, and the text it completes."""
        res = self.result
        res.tokens.append(token)
        res.timings.new_tokens = len(res.tokens)
        if token in self.eos_ids:
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


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def stream(model, prompt, *, tokenizer=None, max_new_tokens: int = 64, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop=None, eos_token_id=_DEFAULT,
           truncate: bool = False, block_size: int = 16, cuda_graph: bool | None = None,
           speculative=None, kv_cache_dtype=None) -> Generation:
    """A generation to iterate: ``prompt`` is text (needs ``tokenizer``) or a list of token ids.

    Stops at ``eos_token_id`` (default: the config's; None never stops on it), at a ``stop`` string (the
    text ends before it), or after ``max_new_tokens``. A prompt that does not leave room for
    ``max_new_tokens`` in the context raises :class:`~tritune.model.engine.scheduler.ContextLimitError` (a
    ValueError); ``truncate=True`` instead keeps its last ``n_positions - max_new_tokens`` tokens.
    ``cuda_graph``, ``speculative``: see :func:`engine_for`; ``kv_cache_dtype``: the engine's ("fp8").
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: text needs a tokenizer (or pass token ids)")
        prompt = tokenizer.encode(prompt)
    return Generation(model, prompt, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
                      eos_token_id=eos_token_id, truncate=truncate, block_size=block_size,
                      cuda_graph=cuda_graph, speculative=speculative, kv_cache_dtype=kv_cache_dtype)


def generate(model, prompt, **kwargs) -> GenerationResult:
    g = stream(model, prompt, **kwargs)
    for _ in g:
        pass
    return g.result
