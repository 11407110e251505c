import torch


def rms_norm(x, weight=None, eps: float = 1e-6, residual=None):
    """y = s * rsqrt(mean(s^2) + eps) * weight over the last dim, in float64, where s = x (+ residual).

    With ``residual`` returns (y, s): the normalised rows and the updated residual stream, the shape of a
    fused add + RMSNorm (the next layer's residual is the sum the norm was taken of). The sum is the one a
    model adding in x's dtype holds (float32 arithmetic, rounded to x's dtype), so s is exactly the stored
    residual stream and y is the norm of that value; float64 from there on."""
    s = x.double()
    if residual is not None:
        if x.dtype == torch.float64:
            s = s + residual.double()
        else:
            s = (x.float() + residual.float()).to(x.dtype).double()
    y = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return (y, s) if residual is not None else y
