"""GPT-2 on tritune kernels."""
