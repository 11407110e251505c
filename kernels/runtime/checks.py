"""Input checks for launchers: at the top of every launcher, with messages that name the argument."""
from __future__ import annotations

import math
from typing import Iterable

import torch

from tritune.kernels.runtime import device as dev

# ---------------------------------------------------------------------------------------------------
# Validation helpers for launchers: checks at the top, messages that name the argument.
# ---------------------------------------------------------------------------------------------------
def check_tensor(name: str, t, *, ndim: int | Iterable[int] | None = None, dtypes=None,
                 device: torch.device | str | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} not supported (expected {names})")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name}: expected a tensor on {torch.device(device).type}, got {t.device}")


BLOCK_SIZES = "a power of two in [1, 256]"   # the paged KV cache's block sizes, as messages name them


def is_block_size(v) -> bool:
    """A paged KV-cache block size the kernels take: their tiles split a block in powers of two."""
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 256 and not v & (v - 1)


def kernel_device() -> str:
    return dev.device()


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors (CPU tensors under the interpreter)."""
    want = kernel_device()
    if t.device.type != want:
        raise ValueError(f"{name}: expected a tensor on {want}, got {t.device}")


def check_vec(name: str, t, n: int, dtype, device, src: str) -> None:
    """A 1-D operand of ``n`` elements of ``src``'s dtype, on its device (a bias, a LayerNorm weight)."""
    check_tensor(name, t, ndim=1)
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype} differs from {src}'s {dtype}")
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but {src} is on {device}")


def check_fusions(ln, kv, m: int, n: int, kdim: int, x, x_name: str, w_name: str) -> int:
    """The LayerNorm prologue and KV-cache write arguments of a linear (gemm's and gemv's ``ln``, ``kv``):
    ``ln`` (weight or None, bias or None, eps) over the K of ``x`` (m, kdim); ``kv`` (k_cache, v_cache,
    slot_mapping) for an N = 3·C output. Returns C (the caches' heads·head_dim; 0 without kv)."""
    if ln is not None:
        ln_w, ln_b, eps = ln
        for name, t in (("ln weight", ln_w), ("ln bias", ln_b)):
            if t is not None:
                check_vec(name, t, kdim, x.dtype, x.device, x_name)
                if t.stride(0) != 1:
                    raise ValueError(f"{name}: expected unit stride, got {t.stride(0)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
            raise ValueError(f"ln eps: expected a finite number >= 0, got {eps!r}")
    if kv is None:
        return 0
    kc, vc, slots = kv
    for name, t in (("k_cache", kc), ("v_cache", vc)):
        check_tensor(name, t, ndim=4)
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {x_name}'s {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but {x_name} is on {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous (num_blocks, block_size, heads, head_dim) cache")
    if kc.shape != vc.shape:
        raise ValueError(f"v_cache: shape {tuple(vc.shape)} differs from k_cache's {tuple(kc.shape)}")
    c_kv = kc.shape[2] * kc.shape[3]
    if n != 3 * c_kv:
        raise ValueError(f"kv: {w_name} has N={n} columns, expected 3 x heads x head_dim = {3 * c_kv} (q, k, v)")
    check_tensor("slot_mapping", slots, ndim=1, dtypes=(torch.int32, torch.int64))
    if slots.shape[0] != m:
        raise ValueError(f"slot_mapping: expected {m} slots (one per row of {x_name}), got {slots.shape[0]}")
    if slots.device != x.device:
        raise ValueError(f"slot_mapping: on {slots.device}, but {x_name} is on {x.device}")
    return c_kv


def check_out(out, shape: tuple, dtype: torch.dtype, device) -> None:
    check_tensor("out", out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out: expected device {device}, got {out.device}")


def extent(t) -> int:
    """Bytes from ``t.data_ptr()`` that its view can reach (0 for None or an empty tensor): metadata
    only, so a launch plan can hold it for :func:`check_no_alias`."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    return span(t) * t.element_size()


def check_no_alias(out, inputs, in_place: str | None = None, extents: tuple | None = None) -> None:
    """Refuse an ``out`` whose memory overlaps an input's: a kernel that writes one tile while another
    program still reads it returns a silently wrong result (``gemm(x, w, out=x)``). ``inputs`` is
    ((name, tensor or None), ...). ``in_place`` names the one input ``out`` may be exactly (same data
    pointer, shape and strides: each element read by the program that writes it, before it writes it),
    the documented in-place case such as ``out=residual``. Byte ranges are compared (conservative: two
    interleaved views of one buffer count as overlapping). Called per launch, only when ``out`` is given;
    ``extents`` (out's, then each input's :func:`extent`) from a launch plan save working them out."""
    if extents is None:
        extents = (extent(out), *(extent(t) for _, t in inputs))
    if not extents[0]:
        return
    o0 = out.data_ptr()
    o1 = o0 + extents[0]
    for (name, t), ext in zip(inputs, extents[1:]):
        if not ext:
            continue
        t0 = t.data_ptr()
        if t0 < o1 and o0 < t0 + ext:
            if name == in_place and t0 == o0 and t.shape == out.shape and t.stride() == out.stride():
                continue
            also = f", or {name} itself (in place)" if name == in_place else ""
            raise ValueError(f"out: overlaps {name} in memory: the kernel would read values it has already "
                             f"overwritten; pass an output that shares no memory with the inputs{also}")



def span(t: torch.Tensor) -> int:
    """1 + the largest element offset of a view: what its addressing must reach (64-bit offsets past 2^31)."""
    s = 1
    for n, st in zip(t.shape, t.stride()):  # a loop, not sum(generator): launch plans take several a call
        s += (n - 1) * abs(st)
    return s


def aligned(*ts) -> bool:
    """Every tensor's base 16-byte aligned (what TMA and 16-byte vector loads need)."""
    return all(t.data_ptr() % 16 == 0 for t in ts)


def tensor_meta(t):
    """What a cached launch plan depends on for an optional tensor argument."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)
