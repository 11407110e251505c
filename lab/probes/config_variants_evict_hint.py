"""Hand-picked configs of a few kernels, each checked against the reference and timed three ways on the
same rotating inputs (GPU only; flush_timing.flush_timings: zero-fill do_bench, clean-flush
do_bench, CUDA graph), plus, per compiled kernel, whether its PTX carries an L2 evict_first hint (is a cache hint kept through
the software pipeline?). Vendor and peers are timed alongside. Writes JSON (--out).

  python lab/probes/config_variants_evict_hint.py --out $OUT/variants.json [--only paged_attention,quant_matmul]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from tritune import kernels
from tritune.harness import bench, compare

import flush_timing  # noqa: E402  (beside this probe)
from tritune.tuning.cli import parse_problems


def pa(bn, part, dot, warps, stages, evict=False, prefetch=False):
    return {"BLOCK_N": bn, "PARTITION": part, "USE_DOT": dot, "num_warps": warps, "num_stages": stages,
            "EVICT": evict, "PREFETCH": prefetch}


def qm(bm, bn, bk, split, warps, stages, prefetch=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
            "num_stages": stages, "PREFETCH": prefetch}


def ln(block, rows, warps, evict):
    return {"BLOCK_N": block, "ROWS": rows, "num_warps": warps, "EVICT": evict}


CASES = [
    ("paged_attention", "B=64,Hq=12,Hkv=12,D=64,ctx=1024,block_size=16", [
        None,
        pa(64, 0, True, 4, 1, True, True), pa(64, 0, True, 4, 1, False, True), pa(64, 0, True, 4, 1, True, False),
        pa(32, 0, True, 4, 1, True, True), pa(32, 0, True, 2, 1, True, True), pa(128, 0, True, 4, 1, True, True),
        pa(128, 0, True, 8, 1, True, True), pa(64, 0, True, 2, 1, True, True),
        pa(64, 0, False, 4, 1, True, True), pa(32, 0, False, 4, 1, True, True), pa(64, 0, False, 4, 1, True, False),
        pa(64, 512, True, 4, 1, True, True),
    ]),
    ("paged_attention", "B=1,Hq=32,Hkv=8,D=128,ctx=4096,block_size=16", [
        None,
        pa(64, 128, True, 4, 1, True, True), pa(64, 128, True, 4, 1, False, True), pa(32, 128, True, 4, 1, True, True),
        pa(32, 64, True, 4, 1, True, True), pa(64, 64, True, 4, 1, True, False), pa(64, 256, True, 4, 1, True, True),
        pa(32, 32, True, 2, 1, True, True), pa(16, 64, True, 2, 1, True, True), pa(64, 128, True, 8, 1, True, True),
        pa(32, 128, False, 4, 1, True, True), pa(16, 64, False, 4, 1, True, True),
    ]),
    ("paged_attention", "B=1,Hq=12,Hkv=12,D=64,ctx=1024,block_size=16", [
        None, pa(64, 128, True, 2, 1, True, True), pa(32, 64, True, 2, 1, True, True), pa(64, 64, True, 2, 1, True, True),
    ]),
    ("quant_matmul", "M=1,N=28672,K=8192,bits=4,group=128", [
        None,
        qm(8, 64, 256, 4, 2, 1, False), qm(8, 64, 256, 4, 4, 1, True), qm(8, 64, 256, 4, 2, 1, True),
        qm(8, 64, 256, 2, 4, 1, True), qm(8, 64, 512, 2, 4, 1, True), qm(8, 64, 256, 1, 4, 1, True),
        qm(8, 128, 256, 4, 4, 1, True), qm(8, 128, 256, 2, 4, 1, True), qm(8, 128, 512, 1, 4, 1, True),
        qm(8, 32, 256, 4, 2, 1, True), qm(8, 32, 256, 8, 2, 1, True), qm(8, 64, 128, 8, 4, 1, True),
        qm(8, 128, 256, 4, 8, 1, True), qm(8, 256, 256, 4, 8, 1, True), qm(8, 256, 512, 2, 8, 1, True),
    ]),
    ("quant_matmul", "M=16,N=28672,K=8192,bits=4,group=128", [
        None, qm(16, 32, 512, 4, 2, 1, True), qm(16, 64, 256, 4, 4, 1, True), qm(16, 128, 256, 4, 4, 1, True),
    ]),
    ("layer_norm", "M=65536,N=4096", [
        None, ln(4096, 1, 8, True), ln(4096, 4, 16, True), ln(4096, 2, 16, True), ln(4096, 1, 16, True),
        ln(4096, 1, 4, True), ln(4096, 4, 16, False),
    ]),
]


def evict_ptx(spec_name: str) -> list[dict]:
    """Each compiled kernel of the spec's module: its constexprs of interest and the evict_first count."""
    import importlib
    mod = importlib.import_module(kernels.get(spec_name).run.__module__)
    out = []
    for name, obj in vars(mod).items():
        caches = getattr(obj, "device_caches", None)
        if not caches:
            continue
        for dev_cache in caches.values():
            cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for ck in cache.values():
                try:
                    ptx = ck.asm["ptx"]
                except Exception:
                    continue
                consts = {}
                try:
                    for k, v in ck.src.constants.items():
                        consts[str(k)] = v if isinstance(v, (int, float, bool, str)) else str(v)
                except Exception:
                    pass
                out.append({"fn": name, "num_stages": getattr(ck.metadata, "num_stages", None),
                            "num_warps": getattr(ck.metadata, "num_warps", None),
                            "evict_first": ptx.count("evict_first"), "cp_async": ptx.count("cp.async."),
                            "constants": {k: v for k, v in consts.items() if len(str(v)) < 40}})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="")
    args = p.parse_args()
    only = set(filter(None, args.only.split(",")))
    rows = []
    ptx = {}
    for name, text, configs in CASES:
        if only and name not in only:
            continue
        spec = kernels.get(name)
        problem = parse_problems(spec, text)[0]
        cases = bench.rotation(spec, problem, torch.bfloat16, "cuda", 0)
        fns = {}
        for cfg in configs:
            label = "store/default" if cfg is None else json.dumps(cfg, separators=(",", ":"))
            if cfg is not None:
                why = spec.space.why_invalid(cfg, problem, torch.bfloat16)
                if why:
                    rows.append({"kernel": name, "problem": text, "who": label, "error": f"invalid: {why}"})
                    continue
            c0 = cases[0]
            try:
                compare.poison(c0.out)
                got = spec.run(*c0.args, out=c0.out, config=cfg, **c0.kwargs)
                want = spec.reference(*c0.args, **c0.kwargs)
                err = compare.rel_error(got, want)
            except Exception as e:
                rows.append({"kernel": name, "problem": text, "who": label, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            fns[label] = (bench.cycling(cases, lambda c, cfg=cfg: lambda c=c: spec.run(*c.args, out=c.out, config=cfg,
                                                                                      **c.kwargs)), err)
        if spec.vendor is not None:
            fns[spec.vendor_name] = (bench.cycling(cases, spec.vendor), None)
        calls, errors = bench.peer_calls(spec, cases)
        fns.update({pname: (fn, None) for pname, fn in calls.items()})
        for pname, why in errors.items():
            print(f"{name}: peer {pname}: {why}")
        for who, (fn, err) in fns.items():
            rows.append(flush_timing.flush_row(fn, kernel=name, problem=text, who=who, rel_error=err))
        del cases, fns
        torch.cuda.empty_cache()
        try:
            ptx[name] = evict_ptx(name)
        except Exception as e:
            ptx[name] = [{"error": f"{type(e).__name__}: {e}"[:200]}]
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows, "ptx": ptx}, f, indent=1)
    for name, ks in ptx.items():
        for k in ks:
            print(name, json.dumps(k)[:300])


if __name__ == "__main__":
    sys.exit(main())
