"""FlashAttention-class peers that install as wheels: flash-attn-4's CuTe-DSL kernels (an sm90 forward:
``flash_attn.cute.interface``). A peer returns None where its package is not installed or the GPU is not
one it runs on, and the bench row records that; the layouts it wants are made outside the timed call.

cuDNN's fused attention is the ``sdpa_cudnn`` peer of the dense spec: torch's SDPA cuDNN backend builds the
cuDNN frontend's SDPA graph, so a separate frontend install would time the same kernels.
"""
from __future__ import annotations

import torch


def _fa4():
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except Exception:   # noqa: BLE001  (absent, or its CUDA runtime missing: no column)
        return None
    return flash_attn_func, flash_attn_varlen_func


def fa4_dense(c):
    """flash-attn-4 on (B, T, H, D) copies of q, k, v (GQA native)."""
    fns = _fa4()
    q, k, v = c.args
    if fns is None or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    causal = c.kwargs.get("causal", False)

    def call():
        return fns[0](qt, kt, vt, causal=causal)

    call()
    return call


def fa4_varlen(c):
    """flash-attn-4's varlen forward on the packed (total, H, D) tensors and the same cu_seqlens."""
    fns = _fa4()
    q, k, v, cu_q, cu_k, max_q, max_k = c.args
    if fns is None or q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    causal = c.kwargs.get("causal", False)
    cu_q32, cu_k32 = cu_q.to(torch.int32), cu_k.to(torch.int32)

    def call():
        return fns[1](q, k, v, cu_seqlens_q=cu_q32, cu_seqlens_k=cu_k32, max_seqlen_q=max_q,
                      max_seqlen_k=max_k, causal=causal)

    call()
    return call
