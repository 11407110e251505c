"""Plain-PyTorch references for every kernel, computing in float64 (no Triton import here)."""
