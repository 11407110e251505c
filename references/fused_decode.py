"""GPT-2's decode step in float64, written as the fused kernel's stages: the judge of
``tritune.kernels.fused_decode``. Plain PyTorch, readable over fast."""
import math

import torch


def _ln(x, w, b, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w.double(), b.double(), eps)


def _gelu_tanh(y):
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y ** 3)))


def fused_decode(x, weights, k_caches, v_caches, slots, block_tables, context_lens, *, n_head: int,
                 eps: float = 1e-5):
    """Logits (M, V) float64 of one decode step of rows x (M, E) (already embedded).

    ``weights``: GPT2Weights (per-layer ln1/qkv/o/ln2/fc/proj, lnf, lm_head (E, V)); ``k_caches``,
    ``v_caches``: per-layer (num_blocks, block_size, H, D) caches holding each row's first ctx − 1 tokens;
    row m's new K/V go to flat slot ``slots[m]`` (< 0: a padding row, nothing written; the reference works
    on float64 copies, the caches given are left as they are); ``context_lens[m]`` tokens are attended,
    the new one included; ``block_tables`` (M, max_blocks)."""
    M, E = x.shape
    H, D = n_head, E // n_head
    x = x.double()
    bs = k_caches[0].shape[1]
    for i, L in enumerate(weights.layers):
        kc = k_caches[i].double().reshape(-1, H, D).clone()
        vc = v_caches[i].double().reshape(-1, H, D).clone()
        qkv = _ln(x, L.ln1_w, L.ln1_b, eps) @ L.w_qkv.double() + L.b_qkv.double()
        q, k, v = qkv.view(M, 3, H, D).unbind(1)
        a = torch.empty((M, H, D), dtype=torch.float64, device=x.device)
        for m in range(M):
            s = int(slots[m])
            if s >= 0:
                kc[s], vc[s] = k[m], v[m]
            n = int(context_lens[m])
            t = torch.arange(n, device=x.device)
            idx = block_tables[m].long()[t // bs] * bs + t % bs
            ks, vs = kc[idx], vc[idx]                                        # (n, H, D)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[m], ks) / math.sqrt(D), dim=-1)
            a[m] = torch.einsum("hn,nhd->hd", p, vs)
        x = x + a.reshape(M, E) @ L.w_o.double() + L.b_o.double()
        f = _gelu_tanh(_ln(x, L.ln2_w, L.ln2_b, eps) @ L.w_fc.double() + L.b_fc.double())
        x = x + f @ L.w_proj.double() + L.b_proj.double()
    return _ln(x, weights.lnf_w, weights.lnf_b, eps) @ weights.lm_head.double()
