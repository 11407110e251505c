import math

import torch

# Scores materialised at once stay under this many elements (float64: 8 bytes each), so the reference
# also runs on the full-size benchmark problems (1 x 32 heads x 16384² would otherwise be 68 GB).
_CHUNK = 1 << 27


def _one_head_group(q, k, v, causal: bool, scale: float, window=None):
    """softmax(q kᵀ · scale + mask) v for q (Hq, Tq, D), k/v (Hkv, Tk, D), in float64; also the lse.

    Query i attends key j when j <= i + Tk − Tq (causal, queries are the last Tq positions), and with a
    ``window`` (local attention) only the window's last keys: i + Tk − Tq − window < j; a row that sees no
    key outputs 0 and its lse is −inf.
    """
    Hq, Tq, D = q.shape
    Hkv, Tk, _ = k.shape
    k = k.double().repeat_interleave(Hq // Hkv, dim=0)
    v = v.double().repeat_interleave(Hq // Hkv, dim=0)
    out = torch.empty(Hq, Tq, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(Hq, Tq, dtype=torch.float64, device=q.device)
    rows = max(1, _CHUNK // max(1, Hq * Tk))
    for i0 in range(0, Tq, rows):
        qi = q[:, i0:i0 + rows].double()
        s = torch.einsum("hid,hjd->hij", qi, k) * scale
        if causal or window is not None:
            i = torch.arange(i0, i0 + qi.shape[1], device=q.device)[:, None]
            j = torch.arange(Tk, device=q.device)[None, :]
            if causal:
                s = s.masked_fill(j > i + (Tk - Tq), float("-inf"))
            if window is not None:
                s = s.masked_fill(j <= i + (Tk - Tq) - window, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows: softmax gives NaN, we define 0
        out[:, i0:i0 + rows] = torch.einsum("hij,hjd->hid", p, v)
        lse[:, i0:i0 + rows] = torch.logsumexp(s, dim=-1)  # −inf for fully masked rows
    return out, lse


def attention(q, k, v, causal: bool = False, scale=None, return_lse: bool = False, window=None, **_):
    """Scaled dot-product attention over (B, H, T, D) tensors in float64; GQA by repeating kv heads;
    ``window``: each query sees only the last ``window`` key positions up to its own (sliding-window attention).

    Returns out (B, Hq, Tq, D), or (out, lse) with lse (B, Hq, Tq) the natural log of the softmax
    denominator (−inf for rows that see no key).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    pairs = [_one_head_group(q[b], k[b], v[b], causal, scale, window) for b in range(q.shape[0])]
    B, Hq, Tq, D = q.shape
    out = torch.stack([o for o, _ in pairs]) if pairs else q.new_zeros((0, Hq, Tq, D), dtype=torch.float64)
    lse = torch.stack([s for _, s in pairs]) if pairs else q.new_zeros((0, Hq, Tq), dtype=torch.float64)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     causal: bool = False, scale=None, return_lse: bool = False, window=None, **_):
    """Packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D); sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1]. Each sequence is attended alone, as :func:`attention` does.

    Returns out (total_q, Hq, D) in float64, or (out, lse) with lse (total_q, Hq).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, s = _one_head_group(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1), causal, scale,
                               window)
        out[qs] = o.transpose(0, 1)
        lse[qs] = s.transpose(0, 1)
    return (out, lse) if return_lse else out
