"""Picking the next token: argument checks, one row's draw (temperature, top-k, top-p), and the engine's
per-step sampler (greedy rows by one argmax; each sampled request with its own seeded generator)."""
from __future__ import annotations

import torch


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
    if temperature == 0:
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
    same tokens whichever requests share its steps."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.generators: dict = {}

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
                gen.manual_seed(int(s.seed))
                self.generators[r.id] = gen
            out.append((i, sample(logits[i:i + 1], s.temperature, s.top_k, s.top_p, gen)))
        return out

    def release(self, request_id) -> None:
        self.generators.pop(request_id, None)
