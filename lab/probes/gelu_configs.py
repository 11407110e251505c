"""GPU probe: every valid GELU config at the standard problems, bf16, against torch (one run)."""
import json, os, sys, functools
import tritune.harness  # noqa
import torch
from tritune import kernels as K
from tritune.harness import bench
spec = K.get("gelu")
rows = []
for p in spec.standard_problems:
    cases = bench.rotation(spec, p, torch.bfloat16, "cuda", 0)
    tv = bench.median_ms(bench.cycling(cases, spec.vendor)) * 1e3
    res = []
    for cfg in spec.space.points(p, torch.bfloat16):
        try:
            t = bench.median_ms(bench.cycling(cases, lambda c: functools.partial(spec.run, *c.args, out=c.out, config=cfg, **c.kwargs))) * 1e3
        except Exception as e:
            continue
        res.append((t, cfg))
    res.sort(key=lambda r: r[0])
    d = spec.default_config(p, torch.bfloat16)
    td = [t for t, c in res if c == d]
    print(p, f"torch {tv:.1f}  default {d} {td}  best:", [(round(t, 1), c) for t, c in res[:4]], flush=True)
    rows.append({"problem": str(p), "torch_us": tv, "default_us": td[0] if td else None, "default": d,
                 "all": [{"us": t, "config": c} for t, c in res]})
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "gelu_configs.json"), "w"), indent=1)
