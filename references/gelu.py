import math

import torch


def gelu(x, approximate: str = "none"):
    """GELU in float64: exact x·Φ(x) = x/2·(1 + erf(x/√2)), or the tanh form."""
    x64 = x.double()
    if approximate == "tanh":
        return 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)))
    return 0.5 * x64 * (1.0 + torch.erf(x64 / math.sqrt(2.0)))
