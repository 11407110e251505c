import math

import torch


def gather(cache, block_table, n: int):
    """The first ``n`` tokens of one sequence from a paged cache: (n, Hkv, D)."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-n // block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=None, window=None, **_):
    """One query token per sequence against its paged K/V, in float64: (B, Hq, D).

    out[b, h] = softmax(q[b, h] · K_b[:, h // G]ᵀ · scale) · V_b[:, h // G], with K_b, V_b the first
    context_lens[b] tokens gathered through block_tables[b] and G = Hq / Hkv query heads per kv head.
    ``window`` W (None: every token): only the last W of them, positions > context_lens[b] − 1 − W (the
    query's own token, the last, is one of the W), as transformers' ``sliding_window`` masks. The tokens
    before are not gathered at all, so whatever they hold cannot reach the output.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, Hq, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        lo = 0 if window is None else max(n - window, 0)
        k = gather(k_cache, block_tables[b], n)[lo:].double().repeat_interleave(group, dim=1)  # (n - lo, Hq, D)
        v = gather(v_cache, block_tables[b], n)[lo:].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """New caches (copies) with token t of k/v stored at flat slot slot_mapping[t]; negative = skip."""
    kc, vc = k_cache.clone(), v_cache.clone()
    nb, bs = kc.shape[:2]
    flat_k = kc.view(nb * bs, *kc.shape[2:])
    flat_v = vc.view(nb * bs, *vc.shape[2:])
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            flat_k[slot] = k[t]
            flat_v[slot] = v[t]
    return kc, vc
