"""A stand-in engine that makes tokens at a fixed rate without a model: the HTTP path's own ceiling.

``StubEngine`` has the surface the engine clients use (:mod:`tritune.model.serve.client`: add_request,
step, abort, has_unfinished, pool, scheduler, config, max_num_seqs, describe). A step admits waiting
requests into free seats, gives every running one ``decode_steps`` tokens through its stream callback
(as the engine's graph path does: several tokens per request per step), retires finished ones, and then
sleeps, with the GIL released as a GPU wait releases it, until the tokens have taken ``1 / rate``
seconds each. ``host_ms``: each step first holds the GIL that long (busy, as the engine's Python host
work holds it), which an engine thread takes from the server's event loop and an engine process does
not. ``rate=inf``: no sleep at all, so the server's HTTP side (parsing, detokenizing, SSE formatting,
sockets) is all that limits the output, which is what ``benchmarks/bench_http.py --stub`` measures on a
machine without a GPU.
"""
from __future__ import annotations

import math
import time
from collections import deque
from types import SimpleNamespace


class _Pool:
    def __init__(self, num_blocks: int):
        self.num_blocks, self.num_used = num_blocks, 0


class StubRequest:
    __slots__ = ("id", "prompt_ids", "max_new_tokens", "sampling", "stream", "output_ids", "finish_reason",
                 "error", "blocks")

    def __init__(self, rid, prompt_ids, sampling, stream):
        self.id, self.prompt_ids, self.sampling, self.stream = rid, prompt_ids, sampling, stream
        self.max_new_tokens = sampling.max_new_tokens
        self.output_ids: list[int] = []
        self.finish_reason = self.error = None
        self.blocks = 0


class StubEngine:
    """Tokens at ``rate`` per second (in total), ``decode_steps`` per request per step, at most
    ``max_num_seqs`` requests running. Token ``k`` of a request is ``(last prompt token + 1 + k) % vocab``
    (greedy-like: the same request gets the same tokens), EOS never."""

    def __init__(self, *, rate: float = math.inf, decode_steps: int = 16, max_num_seqs: int = 256,
                 vocab_size: int = 50257, n_positions: int = 1024, block_size: int = 16, num_blocks: int = 65536,
                 host_ms: float = 0.0, fail_after: int | None = None, fail: str = "raise"):
        if not host_ms >= 0:
            raise ValueError(f"host_ms: expected milliseconds >= 0, got {host_ms!r}")
        self.host_s = host_ms / 1e3
        # For the death tests: from step ``fail_after`` on, "raise" (RuntimeError from step), "exit" (a
        # BaseException that ends the engine process's loop), "segv" / "kill" (the process gets that signal)
        if fail not in ("raise", "exit", "segv", "kill"):
            raise ValueError(f"fail: expected raise, exit, segv or kill, got {fail!r}")
        self.fail_after, self.fail, self.steps = fail_after, fail, 0
        if not rate > 0:
            raise ValueError(f"rate: expected tokens/s > 0 (inf: no pacing), got {rate!r}")
        if not 1 <= decode_steps <= 64:
            raise ValueError(f"decode_steps: expected 1..64, got {decode_steps!r}")
        self.rate, self.decode_steps, self.max_num_seqs = rate, decode_steps, max_num_seqs
        self.block_size = block_size
        self.config = SimpleNamespace(vocab_size=vocab_size, n_positions=n_positions, eos_token_id=None)
        self.model = SimpleNamespace(backend="stub")
        self.pool = _Pool(num_blocks)
        self.scheduler = SimpleNamespace(running=[], waiting=deque())
        self._by_id: dict = {}
        self._n = 0
        self._debt = 0.0        # seconds of pacing owed (sleeps shorter than a millisecond are batched)
        self.tokens = 0

    def describe(self) -> dict:
        return {"backend": "stub", "dtype": "none", "device": "cpu", "rate_tok_s": self.rate,
                "decode_steps": self.decode_steps, "max_num_seqs": self.max_num_seqs, "host_ms": self.host_s * 1e3}

    # -- the engine's surface -----------------------------------------------------------------------------
    def add_request(self, prompt, sampling=None, *, request_id=None, stream=None, **_):
        from tritune.model.engine.scheduler import SamplingParams

        sampling = sampling or SamplingParams()
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: is empty")
        if len(ids) + sampling.max_new_tokens > self.config.n_positions:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens exceeds the context")
        self._n += 1
        req = StubRequest(self._n if request_id is None else request_id, ids, sampling, stream)
        if req.id in self._by_id:
            raise ValueError(f"request_id: {req.id!r} is already queued")
        self._by_id[req.id] = req
        self.scheduler.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    def abort(self, request_id):
        req = self._by_id[request_id]       # KeyError: not queued (finished meanwhile), as the engine says
        self._finish(req, "abort")
        return req

    def step(self) -> list:
        t0 = time.perf_counter()
        self.steps += 1
        if self.fail_after is not None and self.steps > self.fail_after:
            self._fail()
        if self.host_s and (self.scheduler.running or self.scheduler.waiting):
            # the engine's own host work (scheduling, sampling, launches): the GIL held, as Python holds it
            while time.perf_counter() - t0 < self.host_s:
                pass
        sch, pool, vocab = self.scheduler, self.pool, self.config.vocab_size
        while sch.waiting and len(sch.running) < self.max_num_seqs:
            req = sch.waiting.popleft()
            req.blocks = -(-(len(req.prompt_ids) + req.max_new_tokens) // self.block_size)
            pool.num_used += req.blocks
            sch.running.append(req)
        made, finished = 0, []
        for req in list(sch.running):
            base, out, emit = req.prompt_ids[-1] + 1, req.output_ids, req.stream
            k = min(self.decode_steps, req.max_new_tokens - len(out))
            n = len(out)
            toks = [(base + n + j) % vocab for j in range(k)]
            out += toks
            if emit is not None:
                for tok in toks:
                    emit(req, tok)
            made += k
            if len(out) >= req.max_new_tokens:
                self._finish(req, "length")
                finished.append(req)
        self.tokens += made
        if made and math.isfinite(self.rate):     # the "GPU" time of these tokens, GIL released
            self._debt += made / self.rate - (time.perf_counter() - t0)
            if self._debt > 1e-3:
                s = time.perf_counter()
                time.sleep(self._debt)
                self._debt -= time.perf_counter() - s
            self._debt = max(self._debt, -0.05)  # a slow step does not buy a burst later
        return finished

    def _fail(self) -> None:
        if self.fail == "raise":
            raise RuntimeError(f"stub step {self.steps} failed on purpose")
        if self.fail == "exit":
            raise KeyboardInterrupt(f"stub step {self.steps} ended the loop on purpose")
        import os
        import signal

        os.kill(os.getpid(), signal.SIGSEGV if self.fail == "segv" else signal.SIGKILL)
        time.sleep(5)

    def _finish(self, req, reason: str) -> None:
        sch = self.scheduler
        del self._by_id[req.id]
        if req in sch.waiting:
            sch.waiting.remove(req)
        else:
            sch.running.remove(req)
            self.pool.num_used -= req.blocks
        req.finish_reason = reason
        if req.stream is not None:
            req.stream(req, None)
