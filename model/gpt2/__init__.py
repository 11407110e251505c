"""GPT-2 (the first model family): config, Hugging Face weights, the forward on tritune kernels."""
