import torch


def rms_norm(x, weight=None, eps: float = 1e-6, residual=None):
    """y = s * rsqrt(mean(s^2) + eps) * weight over the last dim, in float64, where s = x (+ residual).

    With ``residual`` returns (y, s): the normalised rows and the updated residual stream, the shape of a
    fused add + RMSNorm (the next layer's residual is the sum the norm was taken of)."""
    s = x.double()
    if residual is not None:
        s = s + residual.double()
    y = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return (y, s) if residual is not None else y
