"""Hypothesis strategies shared by every kernel's property tests, and input layouts.

Sizes favour the values that break kernels: 1, primes, one off a power of two, plain powers of two,
then anything up to a cap. The cap depends on where kernels run: the interpreter executes every
program instance in Python, so CPU problems stay small.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from tritune.kernels.runtime.device import interpreted

_SPECIAL = [1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33, 61, 64, 97, 127, 128, 129, 251, 256, 257, 509,
            512, 769, 1000, 1021, 1024, 1536, 2048, 2053, 3072, 4093, 4096, 8191, 8192, 16384, 65521, 65536]


def cap(cpu: int, gpu: int) -> int:
    return cpu if interpreted() else gpu


def sizes(max_value: int, min_value: int = 1) -> st.SearchStrategy[int]:
    special = [s for s in _SPECIAL if min_value <= s <= max_value] or [min_value]
    return st.one_of(st.sampled_from(special), st.integers(min_value, max_value))


def dtypes(allowed=(torch.float32, torch.float16, torch.bfloat16)) -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(list(allowed))


LAYOUTS = ("contiguous", "transposed", "sliced")


def layouts(allowed=LAYOUTS) -> st.SearchStrategy[str]:
    return st.sampled_from(list(allowed))


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as ``t`` laid out as asked.

    contiguous: row-major.  transposed: the last two dims column-major (``x.t().contiguous().t()``).
    sliced: a view into a wider buffer, so rows have a stride larger than their length (the padding
    holds NaN: a kernel that reads past the row end gets caught).
    """
    if layout == "contiguous":
        return t.contiguous()
    if layout == "transposed":
        if t.dim() < 2:
            return t.contiguous()
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        n = t.shape[-1]
        pad = 3 + (n % 5)
        buf = torch.full((*t.shape[:-1], n + pad), float("nan") if t.is_floating_point() else 0,
                         dtype=t.dtype, device=t.device)
        view = buf[..., :n]
        view.copy_(t)
        return view
    raise ValueError(f"layout: unknown {layout!r}; expected one of {LAYOUTS}")


def restride(t: torch.Tensor, *, flip: bool = False, pad: int = 0, offset: int = 0) -> torch.Tensor:
    """The same values as ``t`` in a new buffer: dims stored in ``t``'s stride order (the last two swapped
    when ``flip``), each row padded by ``pad`` elements, the view starting ``offset`` elements in. Padding
    and the lead hold NaN (0 for integers): a kernel that reads another tensor's strides or past a row's end
    reads them. A copy whatever ``t``'s layout (a transposed view stays transposed unless flipped)."""
    nd = t.dim()
    if nd == 0:
        return t.clone()
    order = sorted(range(nd), key=lambda d: (t.stride(d), -d))     # innermost first
    if flip and nd >= 2:
        i, j = order.index(nd - 1), order.index(nd - 2)
        order[i], order[j] = order[j], order[i]
    strides, step = [0] * nd, 1
    for k, d in enumerate(order):
        strides[d] = step
        step *= t.shape[d] + (pad if k == 0 and nd >= 2 else 0)
    buf = torch.full((offset + max(step, 1),), float("nan") if t.is_floating_point() else 0, dtype=t.dtype,
                     device=t.device)
    view = buf.as_strided(t.shape, strides, offset)
    view.copy_(t)
    return view


def generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def randn(shape, dtype, device, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Seeded normal data generated in float32 on ``device`` then cast: never zeros."""
    g = generator(seed, device)
    t = torch.randn(shape, generator=g, dtype=torch.float32, device=device) * scale + shift
    return t.to(dtype=dtype)
