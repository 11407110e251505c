"""The serving engine: scheduler, paged KV cache, runner, CUDA graphs, sampling, speculative decoding,
batch invariance, the fused decode step, generate."""
