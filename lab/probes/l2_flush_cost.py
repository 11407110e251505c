"""How much of a do_bench time is do_bench's own L2 flush? (GPU only.)

triton.testing.do_bench flushes L2 before each timed call by zero-filling a 256 MB buffer, which leaves L2
full of dirty lines: the timed kernel's first ~50 MB of misses then also write those lines back. A kernel
that writes little (attention decode, a GEMV) pays that write-back inside its time; a decode step in a
real model starts from a mostly clean L2 (its kernels write KB, not MB).

For each case this times ours, the vendor path and the peers three ways, on the same rotating inputs:
  zero:  do_bench as is (what every table reports)
  clean: do_bench with the zero-fill followed by a read of a 128 MB buffer (L2 left holding clean lines:
         still cold for the kernel, no write-back charged to it)
  graph: replayed in a CUDA graph, inputs cycled past L2 (harness.bench.graph_ms)
and writes the table as JSON (--out).
"""
from __future__ import annotations

import argparse
import json

import torch

from tritune import kernels
from tritune.harness import bench

import flush_timing  # noqa: E402  (beside this probe)
from tritune.tuning.cli import parse_problems

CASES = [
    ("paged_attention", "B=64,Hq=12,Hkv=12,D=64,ctx=1024,block_size=16"),
    ("paged_attention", "B=1,Hq=32,Hkv=8,D=128,ctx=4096,block_size=16"),
    ("quant_matmul", "M=1,N=28672,K=8192,bits=4,group=128"),
    ("gemm", "M=1,N=2304,K=768,bias=True"),
    ("gelu", "numel=268435456,approximate=tanh"),
    ("layer_norm", "M=65536,N=4096"),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = []
    for name, text in CASES:
        spec = kernels.get(name)
        problem = parse_problems(spec, text)[0]
        cases = bench.rotation(spec, problem, torch.bfloat16, "cuda", 0)
        cfg = spec.config_for(problem, torch.bfloat16)
        fns = {"ours": bench.cycling(cases, lambda c: lambda c=c: spec.run(*c.args, out=c.out, config=cfg, **c.kwargs))}
        if spec.vendor is not None:
            fns[spec.vendor_name] = bench.cycling(cases, spec.vendor)
        calls, errors = bench.peer_calls(spec, cases)
        fns.update(calls)
        for pname, why in errors.items():  # a peer that is not installed
            print(f"{name}: peer {pname}: {why}")
        for who, fn in fns.items():
            rows.append(flush_timing.flush_row(fn, kernel=name, problem=text, who=who))
        del cases, fns
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
