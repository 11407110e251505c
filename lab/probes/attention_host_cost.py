"""Where attention's host time per call goes (a GPU question: the bench's `host µs` column for attention rose
from ~45 to 90-180 µs once the TMA=2 and Gluon paths came in). Host microseconds per call (launches queued,
no sync, as harness.bench.host_us) of tritune.attention under each path's config, of the launch alone with
its arguments made beforehand, of each piece of the wrapper (the plan key, torch.empty, the descriptors),
of SDPA and of a one-argument Triton kernel; then cProfile of the default config's calls.

  python lab/probes/attention_host_cost.py [--out FILE] [--calls N]
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritune.kernels import _attention_gluon as G
from tritune.kernels import attention as A


@triton.jit
def _noop(X):
    pass


def host_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return round(best, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    n = a.calls
    dt = torch.bfloat16
    B, H, T, D = 8, 12, 1024, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dt) for _ in range(3))
    p = A.Problem(B, H, H, T, T, D, True)
    out = torch.empty_like(q)
    base = dict(A.default_config(p, dt))
    cfgs = {"stored_or_default": None,
            "tma0": dict(base, TMA=0, WARP_SPEC=0),
            "tma1": dict(base, TMA=1, WARP_SPEC=0),
            "tma2": dict(base, TMA=2, WARP_SPEC=0),
            "gluon_ws4": A.gluon_config(p, dt, schedule=1, BLOCK_N=128, num_stages=3)}
    r = {"cpu": os.cpu_count(), "loadavg": os.getloadavg(), "problem": str(p), "calls": n}
    x = torch.empty(16, device="cuda")
    r["triton_noop_1arg"] = host_us(lambda: _noop[(1,)](x), n)
    r["torch_empty"] = host_us(lambda: torch.empty((B, H, T, D), dtype=dt, device="cuda"), n)
    r["sdpa"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), n)
    for name, cfg in cfgs.items():
        if cfg is not None and A.SPACE.why_invalid(cfg, p, dt):
            r[name] = "invalid: " + A.SPACE.why_invalid(cfg, p, dt)
            continue
        r[name] = host_us(lambda cfg=cfg: A.attention(q, k, v, causal=True, config=cfg), n)
        r[name + "_out"] = host_us(lambda cfg=cfg: A.attention(q, k, v, causal=True, config=cfg, out=out), n)
    # pieces of the wrapper
    key = lambda: (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,  # noqa: E731
                   v.shape, v.stride(), v.dtype, v.device, None, True, None, type(None), False, None,
                   A.K.precision_key(q.dtype))
    r["piece_key"] = host_us(key, n)
    r["piece_aligned"] = host_us(lambda: A._aligned(q, k, v, out), n)
    A.attention(q, k, v, causal=True, config=cfgs["tma2"])
    plan = A._PLANS.get(next(kk for kk in A._PLANS if kk[-2] is not None and dict(kk[-2]).get("TMA") == 2))
    meta = A._launch_meta(plan, q, k, v, out)
    r["piece_descs_tma2"] = host_us(lambda: A._descs(plan, meta, q, k, v, out), n)
    descs = A._descs(plan, meta, q, k, v, out)
    r["launch_only_tma2"] = host_us(lambda: A._attn_fwd[plan.grid](q, k, v, out, out, q, q, *descs, *plan.strides,
                                                                    *plan.scalars, **meta), n)
    r["piece_gluon_descriptors"] = host_us(lambda: G.descriptors(q, k, v, out, 128), n)
    gd, rank, grid = G.descriptors(q, k, v, out, 128)
    r["launch_only_gluon"] = host_us(lambda: G._fa3_fwd[grid](*gd, 0.18, T, T, H, H, out, 0, 0, 0, STORE_LSE=False,
                                                             STAGES=3, CAUSAL=True, SCHEDULE=1, RANK=rank,
                                                             num_warps=4, maxnreg=G.MAXNREG), n)
    for name in ("stored_or_default", "gluon_ws4"):
        cfg = cfgs[name]
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(1000):
            A.attention(q, k, v, causal=True, config=cfg)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        r["profile_" + name] = s.getvalue()
    print(json.dumps({kk: vv for kk, vv in r.items() if not kk.startswith("profile")}, indent=1))
    for kk, vv in r.items():
        if kk.startswith("profile"):
            print(kk)
            print("\n".join(vv.splitlines()[:45]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
