"""Quantized weights: the load-time swap (ops), round-to-nearest / GPTQ / AWQ quantization, HF checkpoints."""
