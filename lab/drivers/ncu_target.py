"""A few launches of one kernel for Nsight Compute (GPU only):
  ncu --clock-control none --set full -k regex:_qmm_dot --launch-skip 2 --launch-count 1 \
      python lab/drivers/ncu_target.py int4
int4 / int8: quant_matmul M=1 on (8192, 28672) with the stored config; paged: B=1 Llama ctx 4096;
fused: the fused decode step (one persistent launch), GPT-2 small at batch 1."""
from __future__ import annotations

import sys

import torch

from tritune import kernels
from tritune.tuning.cli import parse_problems

WHAT = {"int4": ("quant_matmul", "M=1,N=28672,K=8192,bits=4,group=128"),
        "int8": ("quant_matmul", "M=1,N=28672,K=8192,bits=8,group=128"),
        "paged": ("paged_attention", "B=1,Hq=32,Hkv=8,D=128,ctx=4096,block_size=16"),
        "gemm64": ("gemm", "M=64,N=2304,K=768,bias=True")}

if sys.argv[1] == "fused":   # the fused decode step, GPT-2 small (random init), batch 1, its default config
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    import bench_fused_decode as B
    from tritune.model.fused_decode import FusedDecode
    from tritune.model.gpt2 import PagedKVCache

    model = B.random_gpt2(12, 768, 12)
    kv = PagedKVCache(model.config, 64, 16, model.dtype, "cuda")
    fd = FusedDecode(model, kv, max_rows=1)
    x0 = torch.randn(1, 768, device="cuda", dtype=model.dtype)
    slots = torch.tensor([200], dtype=torch.int32, device="cuda")
    bt = torch.arange(64, dtype=torch.int32, device="cuda")[None, :]
    ctx = torch.tensor([201], dtype=torch.int32, device="cuda")
    for _ in range(4):
        fd(x0.clone(), slots, bt, ctx)
    torch.cuda.synchronize()
    fd.check()
    print("ran fused decode, GPT-2 small, batch 1, context 201")
    sys.exit(0)
name, text = WHAT[sys.argv[1]]
spec = kernels.get(name)
problem = parse_problems(spec, text)[0]
c = spec.make_inputs(problem, torch.bfloat16, "cuda", 0)
for _ in range(4):
    spec.run(*c.args, out=c.out, **c.kwargs)
torch.cuda.synchronize()
print("ran", name, text)
