"""Picking the next token: the request's sampling parameters (checked in one place), one row's draw
(temperature, top-k, top-p), and the engine's per-step sampler (greedy rows by one argmax; each sampled
request with its own seeded generator; a row that cannot be drawn fails alone).

Temperature: 0 is greedy, and so is anything below :data:`TEMPERATURE_FLOOR` (1e-5): dividing fp32 logits
by a smaller temperature overflows to inf (``temperature=1e-40``), and long before that the distribution is
the argmax's in all but ties. :class:`SamplingParams` stores such a temperature as 0.0, so every path (the
host sampler, the device-side step, speculative decoding) treats the request as the greedy one it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TEMPERATURE_FLOOR = 1e-5        # temperatures below this are greedy (the module docstring)
SEED_LIMIT = 2 ** 63            # seeds are ints in [0, 2**63): what torch.Generator.manual_seed takes


class SamplingTypeError(TypeError, ValueError):
    """A sampling argument of the wrong type: a TypeError, and a ValueError as these checks always raised."""


def _int(name: str, v, lo: int, hi: int | None = None, what: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingTypeError(f"{name}: expected an int{what}, got {type(v).__name__} {v!r}")
    if v < lo or (hi is not None and v >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi if hi != SEED_LIMIT else '2**63'})"
        raise ValueError(f"{name}: expected an int {rng}{what}, got {v!r}")
    return v


def _number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingTypeError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
    return float(v)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """temperature a finite number >= 0, top_k an int >= 0, top_p a number in (0, 1]; ValueError/TypeError
    naming the argument otherwise."""
    t = _number("temperature", temperature)
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature: expected a finite number >= 0 (0 is greedy), got {temperature!r}")
    _int("top_k", top_k, 0, what=" (0 disables it)")
    p = _number("top_p", top_p)
    if not 0 < p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, every field checked here (TypeError/ValueError naming it).

    ``temperature``: 0 is greedy, and below :data:`TEMPERATURE_FLOOR` too (stored as 0.0); ``top_k``: 0
    disables it; ``top_p`` in (0, 1]; ``seed``: None or an int in [0, 2**63) (the same seed, the same draws
    whatever else shares the steps); ``stop_token_ids``: ints >= 0; ``stop``: non-empty strings (checked on
    the text by the engine, which needs the tokenizer for them); ``ignore_eos``: a bool. The scheduler
    stops on EOS, ``stop_token_ids`` and ``max_new_tokens``.
    """
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0                  # 0: no top-k
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        _int("max_new_tokens", self.max_new_tokens, 1)
        check_sampling(self.temperature, self.top_k, self.top_p)
        t = float(self.temperature)
        object.__setattr__(self, "temperature", 0.0 if t < TEMPERATURE_FLOOR else t)
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.seed is not None:
            _int("seed", self.seed, 0, SEED_LIMIT)
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise SamplingTypeError(f"stop_token_ids: expected a sequence of ints, got {type(ids).__name__} {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(
            _int("stop_token_ids", t.__index__() if hasattr(t, "__index__") and not isinstance(t, bool) else t, 0)
            for t in ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not hasattr(stop, "__iter__"):
            raise SamplingTypeError(f"stop: expected a string or strings, got {type(stop).__name__} {stop!r}")
        stop = tuple(stop)
        if any(not isinstance(x, str) for x in stop):
            raise SamplingTypeError(f"stop: expected strings, got {stop!r}")
        if any(not x for x in stop):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingTypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__} {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SamplingError(ValueError):
    """One row's token could not be drawn (its distribution is not finite): that request ends alone."""


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token per row of ``logits`` (B, V) -> (B,) int64. temperature 0 is greedy (argmax).

    Top-k keeps the k largest logits; top-p then keeps the smallest set of most likely tokens whose
    probability reaches p (the most likely token always survives). Sampling draws from ``generator``, so
    a seeded generator gives the same tokens for the same logits.
    """
    if temperature < TEMPERATURE_FLOOR:
        return logits.float().argmax(dim=-1)
    return torch.multinomial(probs(logits, temperature, top_k, top_p), 1, generator=generator).squeeze(-1)


def probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution :func:`sample` draws from at ``temperature`` > 0, (..., V) float32: speculative
    decoding's acceptance rule needs it as a whole, not just one draw from it."""
    logits = logits.float() / temperature
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        p = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p
        drop = p.cumsum(dim=-1) - p >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(dim=-1)


class Sampler:
    """The tokens of one step's rows: one argmax for all, then a draw for each sampled request from its
    own generator (seeded at its first draw, kept until :meth:`release`), so a seeded request gets the
    same tokens whichever requests share its steps.

    A row whose distribution is not finite (its logits hold inf or nan) is drawn from a placeholder, so the
    draw never raises and consumes the randomness it would have, and is reported by :meth:`failures` after
    the step's host sync: the engine ends that request alone, and the other rows keep their tokens bit for
    bit. Nothing here reads the device before that sync (the device-side step draws between replays)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.generators: dict = {}
        self._checks: list = []      # (request, (1,) bool tensor: the row's distribution was finite)

    def __call__(self, requests, logits: torch.Tensor) -> list[int]:
        toks = logits.argmax(dim=-1)
        drawn = self.draw(requests, logits)
        if drawn:
            toks = toks.clone()
            for i, t in drawn:
                toks[i:i + 1] = t
        return toks.tolist()        # the one sync

    def draw(self, requests, logits: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The sampled rows' tokens left on the device, as (row, (1,) tensor): no host sync, so the
        device-side decode step can feed them back between replays. Greedy rows are not drawn."""
        out = []
        for i, r in enumerate(requests):
            s = r.sampling
            if s.temperature == 0:
                continue
            gen = self.generators.get(r.id)
            if gen is None and s.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(s.seed)
                self.generators[r.id] = gen
            p = probs(logits[i:i + 1], s.temperature, s.top_k, s.top_p)
            ok = torch.isfinite(p).all(dim=-1) & (p.sum(dim=-1) > 0)
            self._checks.append((r, ok))
            p = torch.where(ok[:, None], p, torch.ones_like(p))
            out.append((i, torch.multinomial(p, 1, generator=gen).squeeze(-1)))
        return out

    def failures(self) -> list[tuple[object, SamplingError]]:
        """(request, error) of each row drawn since the last call whose distribution was not finite. Call it
        after the step's host sync (it reads the checks in one transfer)."""
        checks, self._checks = self._checks, []
        if not checks:
            return []
        oks = torch.cat([ok for _, ok in checks]).tolist()
        bad, seen = [], set()
        for (r, _), ok in zip(checks, oks):
            if not ok and id(r) not in seen:
                seen.add(id(r))
                bad.append((r, SamplingError(f"request {r.id!r}: its next-token distribution is not finite "
                                             f"(logits hold inf or nan at temperature {r.sampling.temperature})")))
        return bad

    def release(self, request_id) -> None:
        self.generators.pop(request_id, None)
