"""A few launches of one kernel for Nsight Compute (GPU only):
  ncu --clock-control none --set full -k regex:_qmm_dot --launch-skip 2 --launch-count 1 \
      python lab/drivers/ncu_target.py int4
int4 / int8: quant_matmul M=1 on (8192, 28672) with the stored config; paged: B=1 Llama ctx 4096."""
from __future__ import annotations

import sys

import torch

from tritune import kernels
from tritune.tuning.cli import parse_problems

WHAT = {"int4": ("quant_matmul", "M=1,N=28672,K=8192,bits=4,group=128"),
        "int8": ("quant_matmul", "M=1,N=28672,K=8192,bits=8,group=128"),
        "paged": ("paged_attention", "B=1,Hq=32,Hkv=8,D=128,ctx=4096,block_size=16"),
        "gemm64": ("gemm", "M=64,N=2304,K=768,bias=True")}

name, text = WHAT[sys.argv[1]]
spec = kernels.get(name)
problem = parse_problems(spec, text)[0]
c = spec.make_inputs(problem, torch.bfloat16, "cuda", 0)
for _ in range(4):
    spec.run(*c.args, out=c.out, **c.kwargs)
torch.cuda.synchronize()
print("ran", name, text)
