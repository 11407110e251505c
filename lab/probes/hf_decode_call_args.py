"""What HF generate passes to the compiled decode call (get_compiled_call's callable) each step, static
cache: per step the kwargs' names, tensors' shapes/dtypes/devices/data_ptrs, non-tensor values, and the
cache object's id and its tensors' addresses; over generates of the same and of different batch sizes.
CPU, tiny GPT-2 (patched), eager (the returned callable is the model's own __call__, logged).

    python lab/probes/hf_decode_call_args.py
"""
from __future__ import annotations

import torch
import transformers

from tritune.model import hf_patch


def describe(k, v):
    if isinstance(v, torch.Tensor):
        return f"{k}: T{tuple(v.shape)} {str(v.dtype)[6:]} {v.device.type} ptr={v.data_ptr() % 100000}"
    if isinstance(v, transformers.cache_utils.Cache):
        ptrs = [lay.keys.data_ptr() % 100000 for lay in v.layers if getattr(lay, "keys", None) is not None]
        return f"{k}: {type(v).__name__} id={id(v) % 100000} keys={ptrs}"
    return f"{k}: {v!r}"


def main():
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64,
                                                             n_layer=2, n_head=2)).eval()
    hf_patch.patch(m)
    m.generation_config.pad_token_id = 0
    cc = transformers.CompileConfig(fullgraph=True, mode=None, backend="eager")
    cc._compile_all_devices = True
    m.generation_config.compile_config = cc

    def get_compiled_call(compile_config):
        def call(**kw):
            print("   step", "; ".join(describe(k, v) for k, v in sorted(kw.items())))
            return m(**kw)
        return call

    m.get_compiled_call = get_compiled_call
    for B, T, pad in ((2, 5, False), (2, 5, False), (3, 7, False), (2, 5, True)):
        ids = torch.randint(1, 128, (B, T))
        kw = {}
        if pad:
            am = torch.ones(B, T, dtype=torch.long)
            am[0, :2] = 0
            kw["attention_mask"] = am
        print(f"generate B={B} T={T} pad={pad}")
        with torch.no_grad():
            m.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static", **kw)


if __name__ == "__main__":
    main()
