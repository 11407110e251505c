import math

import torch


def gelu(x, approximate: str = "none"):
    """GELU in float64: exact x·Φ(x) = x/2·erfc(−x/√2), or the tanh form.

    erfc, not 1 + erf: the latter cancels for x < −5 even in float64 (10% error at x = −8).
    """
    x64 = x.double()
    if approximate == "tanh":
        return 0.5 * x64 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)))
    return 0.5 * x64 * torch.erfc(-x64 / math.sqrt(2.0))
