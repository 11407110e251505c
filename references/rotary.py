"""Rotary position embedding (RoPE), in float64, in the "neox" layout Hugging Face's Llama uses: the first
``rotary_dim`` dims of each head are two halves (x1, x2), rotated as (x1·cos − x2·sin, x2·cos + x1·sin) by
the angles of the token's position; dims past ``rotary_dim`` pass through."""
import torch


def rotate(x, cos, sin, positions):
    """x (T, H, D); cos, sin (P, R/2) with R <= D; positions (T,) indices into the tables."""
    c = cos.double()[positions.long()][:, None, :]
    s = sin.double()[positions.long()][:, None, :]
    half = c.shape[-1]
    x = x.double()
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def rotary(q, k, cos, sin, positions):
    """(q, k) rotated: q (T, Hq, D), k (T, Hk, D)."""
    return rotate(q, cos, sin, positions), rotate(k, cos, sin, positions)
