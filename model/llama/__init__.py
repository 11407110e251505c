"""The Llama family (Llama, Qwen2, Qwen3, Mistral): config, Hugging Face weights, the forward on tritune kernels."""
