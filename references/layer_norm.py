import torch


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, return_stats: bool = False):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim, in float64."""
    x64 = x.double()
    mean = x64.mean(dim=-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (x64 - mean) * rstd
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    if return_stats:
        return y, mean.squeeze(-1), rstd.squeeze(-1)
    return y
