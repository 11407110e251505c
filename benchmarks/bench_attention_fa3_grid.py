"""Prefill attention on FlashAttention-3's benchmark grid, against torch's SDPA (default dispatch and each
backend forced), on the GPU.

The grid (FA3's paper): batch x seqlen = 16k tokens, heads x D = 2048, seqlen 1k..16k, D 64 and 128,
causal and not, bf16 and fp16. For each point: ours with the launcher's own config (tuned store, else the
heuristic default), ours with the best of a small on-the-spot sweep of the Hopper keys (TMA, SCHEDULE,
LAZY_RESCALE, BLOCK_N, num_stages; the full sweep on bf16, fp16 times its default and the bf16 winner),
SDPA default and SDPA forced to flash, efficient and cudnn. Every config of ours is checked against
SDPA's output first (relative error within twice the dtype's tolerance, no unwritten row); one that
fails to compile, run or match is recorded with why and not timed. Times are do_bench medians
(tritune.harness.bench.median_ms); TF/s counts 4·B·H·T²·D flops, halved under causal masking.

    python benchmarks/bench_attention_fa3_grid.py [--results DIR] [--budget-s 230] [--emit DIR] [--seqlens 1024,...]
    python benchmarks/bench_attention_fa3_grid.py --rows worst --sweep new --rounds 2 --peers none --dtypes bf16

The second form is the A/B of the newer config points (TMA=2 host-built descriptors, SCHEDULE="ahead": scores
one block ahead, smaller key blocks, 64-row tiles, the other grid order) on the rows where the grid is
weakest (D=128 at 1k-2k tokens; --rows also takes "D=128,T=1024,causal;D=64,T=2048,full"). Each
candidate is timed once per round, the rounds in alternating order (the min is kept, every round's
time recorded), and each row prints one line per candidate.

Appends every row, keyed (benchmarks/rows.py), to results/<gpu-slug>/attention_fa3_grid.json (the summary
and the environment as its top-level fields) and prints a compact table and
the targets (>= 1.0x default SDPA at every point, >= 1.1x at the median, D=128 16k >= 600 TF/s
non-causal and >= 560 causal). --emit also writes the winning configs as store entries under
DIR/<gpu-slug>/attention.json (copy into tuning/configs/ to ship them). Bounded: the run checks
its time budget before every timing and stops early, saying so, once it is spent.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from rows import commit, write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

SEQLENS = (1024, 2048, 4096, 8192, 16384)
TOKENS, WIDTH = 16384, 2048
# the weakest rows of the H100 grid (run at 6b00e06, bf16, best of the
# sweep against SDPA's cuDNN): D=128 causal 1k 0.652x, full 1k 0.724x, causal 2k 0.716x
WORST = ((128, True, 1024), (128, False, 1024), (128, True, 2048))
PEERS = ("flash", "efficient", "cudnn", "fa4")   # SDPA forced to each backend; flash-attn-4 (CuTe, sm90)


PIPE, WS, AHEAD = "pipelined", "warp_specialized", "ahead"   # the Triton kernel's SCHEDULE values


def sweep(default: dict, D: int) -> list[dict]:
    """The on-the-spot candidates: the default, the pointer path, each Hopper key alone and together,
    and a few tile/stage neighbours of the default on the TMA path."""
    tma = dict(default, TMA=1)
    alt_n = 64 if default["BLOCK_N"] == 128 else 128
    cands = [default, dict(default, TMA=0, SCHEDULE=PIPE), tma, dict(tma, SCHEDULE=WS), dict(tma, LAZY_RESCALE=1),
             dict(tma, SCHEDULE=WS, LAZY_RESCALE=1), dict(tma, BLOCK_N=alt_n), dict(tma, num_stages=2),
             dict(tma, num_stages=4), dict(tma, BLOCK_M=64, num_warps=4)]
    return _unique(cands)


def sweep_new(default: dict, D: int, causal: bool) -> list[dict]:
    """The A/B of the newer points against the default and the old Hopper points: descriptors made on
    the host (TMA=2: no per-program descriptor writes, the cost the short rows pay most), scores one
    block ahead (SCHEDULE="ahead") on either load path, smaller key blocks / fewer stages (less shared memory:
    room for a second program per SM to hide the first one's prologue and epilogue), 64-row tiles, and
    the grid order flipped (HEADS_INNER)."""
    host = dict(default, TMA=2, SCHEDULE=PIPE)
    alt_n = 64 if default["BLOCK_N"] == 128 else 128
    cands = [default, dict(default, TMA=0, SCHEDULE=PIPE), dict(default, TMA=1, SCHEDULE=PIPE),
             dict(default, TMA=1, SCHEDULE=WS), host, dict(host, SCHEDULE=AHEAD), dict(default, TMA=0, SCHEDULE=AHEAD),
             dict(host, BLOCK_N=alt_n), dict(host, BLOCK_N=alt_n, SCHEDULE=AHEAD), dict(host, num_stages=2),
             dict(host, BLOCK_N=64, num_stages=2), dict(host, HEADS_INNER=1 - default["HEADS_INNER"]),
             dict(host, BLOCK_M=64, num_warps=4), dict(default, TMA=0, SCHEDULE=PIPE, BLOCK_M=64, num_warps=4)]
    return _unique(cands)


def sweep_gluon(A, p, dtype) -> list[dict]:
    """The Gluon FA3-structured kernel (attention's IMPL="gluon", ``A.gluon_config``) beside the default:
    FA3's two schedules (1: intra-warpgroup overlap, 2: plus ping-pong) at 64- and 128-key tiles, 2 and 3
    stages (the space refuses what does not fit), and schedule 0 at the default tile."""
    bn0 = A.gluon_config(p, dtype)["BLOCK_N"]
    cands = [A.default_config(p, dtype)] + [A.gluon_config(p, dtype, sch, bn, st) for sch in (2, 1)
                                            for bn in (bn0, 64, 128) for st in (2, 3)]
    return _unique(cands + [A.gluon_config(p, dtype, 0)])


def sweep_stages(A, p, dtype, own: dict) -> list[dict]:
    """The Gluon kernel's ring depth: FA3's two schedules at 64- and 128-key tiles and 2 to 5 stages (the space
    refuses what does not fit), beside the launcher's own config."""
    return _unique([own] + [A.gluon_config(p, dtype, sch, bn, st) for sch in (1, 2) for bn in (64, 128)
                            for st in (2, 3, 4, 5)])


def sweep_persistent(A, p, dtype, own: dict) -> list[dict]:
    """The Gluon kernel's persistent form (PERSISTENT=1): schedules 1 and 2 at 64- and 128-key tiles and 3-4
    stages (the space refuses what does not fit), beside the launcher's own config and the default."""
    return _unique([own, A.default_config(p, dtype)] + [
        A.gluon_config(p, dtype, sch, bn, st, persistent=True) for sch in (1, 2) for bn in (64, 128) for st in (3, 4)])


def sweep_wg3(A, p, dtype, own: dict) -> list[dict]:
    """The Gluon kernel's CTA of three consumer warpgroups (BLOCK_M=192, FA3's at D <= 64): every schedule,
    dense and persistent, at 64- and 128-key tiles (the space refuses what spills or does not fit), beside the launcher's
    own config. D <= 64: 3-4 stages (2 never won there); past it 2-3."""
    stages = (3, 4) if p.D <= 64 else (2, 3)
    return _unique([own] + [
        A.gluon_config(p, dtype, sch, bn, st, persistent=pers, BLOCK_M=192)
        for sch, pers in (("pingpong", False), ("intra_wg", False), ("pingpong", True), ("intra_wg", True),
                          ("ahead", False)) for bn in (128, 64) for st in stages])


def _unique(cands: list[dict]) -> list[dict]:
    out, seen = [], set()
    for c in cands:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def parse_rows(text: str, seqlens: list[int]) -> list[tuple[int, bool, int]]:
    """(D, causal, T) points: "all" (the grid), "worst" (WORST), or "D=128,T=1024,causal;D=64,T=2048,full"."""
    if text == "all":
        return [(D, c, T) for D in (128, 64) for c in (False, True) for T in seqlens]
    if text == "worst":
        return list(WORST)
    rows = []
    for part in filter(None, (x.strip() for x in text.split(";"))):
        kv = dict(f.split("=", 1) if "=" in f else (f, "1") for f in part.split(","))
        mask = "causal" if "causal" in kv else "full" if "full" in kv else None
        try:
            D, T = int(kv["D"]), int(kv["T"])
        except (KeyError, ValueError):
            raise ValueError(f"--rows: {part!r} needs D=<int>,T=<int> and causal or full")
        if mask is None or D not in (64, 128) or T <= 0 or TOKENS % T:
            raise ValueError(f"--rows: {part!r}: D is 64 or 128, T divides {TOKENS}, mask causal or full")
        rows.append((D, mask == "causal", T))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=Path("results"), help="results root (default: results)")
    ap.add_argument("--budget-s", type=float, default=230.0)
    ap.add_argument("--emit", type=Path, default=None, metavar="DIR",
                    help="write the winners as store entries under DIR/<gpu-slug>/attention.json")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--rows", default="all", help='all | worst | "D=128,T=1024,causal;D=64,T=2048,full"')
    ap.add_argument("--sweep", choices=("grid", "new", "gluon", "stages", "persistent", "wg3", "none"), default="grid",
                    help="grid: the Hopper keys around the default; new: the A/B of the newer points; gluon: the "
                         "Gluon FA3 kernel's points (both dtypes); stages: its ring depth, 2 to 5; persistent: its "
                         "persistent form; wg3: its CTAs of three consumer warpgroups; none: the stored config alone")
    ap.add_argument("--rounds", type=int, default=1, help="time each candidate this many times (alternating order)")
    ap.add_argument("--peers", default=",".join(PEERS), help="SDPA backends to force, or none")
    args = ap.parse_args(argv)
    try:
        rows_wanted = parse_rows(args.rows, [int(s) for s in args.seqlens.split(",")])
    except ValueError as e:
        ap.error(str(e))  # one line, exit 2
    peers = [] if args.peers == "none" else args.peers.split(",")
    if any(pn not in PEERS for pn in peers):
        ap.error(f"--peers: expected some of {','.join(PEERS)} or none, got {args.peers}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tritune import kernels as K
    from tritune.harness import bench
    from tritune.kernels.runtime import compare as cmp
    from tritune.kernels.runtime import device as dev
    from tritune.kernels import attention as A

    if dev.interpreted():
        print("bench_attention_fa3_grid: needs a CUDA GPU (the interpreter cannot time kernels)")
        return 2
    t_start = time.perf_counter()
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    seqlens = [int(s) for s in args.seqlens.split(",")]
    rows, winners = [], {}
    stopped = None

    def timed(fn):
        if left() <= 0:
            raise TimeoutError("time budget spent")
        return bench.median_ms(fn) * 1e3

    for dname in args.dtypes.split(","):
        dtype = dtypes[dname]
        for D in (128, 64):
            H = WIDTH // D
            for causal in (False, True):
                for T in seqlens if args.rows == "all" else [t for d, c, t in rows_wanted if (d, c) == (D, causal)]:
                    B = max(1, TOKENS // T)
                    p = A.Problem(B, H, H, T, T, D, causal)
                    row = {"dtype": dname, "B": B, "H": H, "T": T, "D": D, "causal": causal}
                    flops = A.cost(p, dtype).flops
                    tfs = lambda us: round(flops / (us * 1e-6) / 1e12, 1)  # noqa: E731
                    if stopped:
                        row["skipped"] = stopped
                        rows.append(row)
                        continue
                    try:
                        q, k, v = A.make_inputs(p, dtype, "cuda", 0).args
                        out = torch.empty_like(q)
                        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                        row["sdpa_backend"] = K.sdpa_backend(sdpa)
                        row["sdpa_us"] = timed(sdpa)
                        for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                                         ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                         ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                            if name not in peers:
                                continue
                            def forced(be=be):
                                with sdpa_kernel(be):
                                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            try:
                                forced()
                                row[f"sdpa_{name}_us"] = timed(forced)
                            except TimeoutError:
                                raise
                            except Exception as e:  # that backend cannot run this case
                                row[f"sdpa_{name}_us"] = None
                                row[f"sdpa_{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                        if "fa4" in peers:
                            _fa4_column(row, q, k, v, causal, want, timed, dtype)
                        own = A.SPEC.config_for(p, dtype)
                        default = A.default_config(p, dtype)
                        if args.sweep == "new":
                            cands = sweep_new(default, D, causal)
                        elif args.sweep == "gluon":
                            cands = sweep_gluon(A, p, dtype)
                        elif args.sweep == "stages":
                            cands = sweep_stages(A, p, dtype, own)
                        elif args.sweep == "persistent":
                            cands = sweep_persistent(A, p, dtype, own)
                        elif args.sweep == "wg3":
                            cands = sweep_wg3(A, p, dtype, own)
                        elif args.sweep == "none":
                            cands = [own]
                        elif dname == "bf16":
                            cands = sweep(default, D)
                        else:
                            w = winners.get(("bf16", D, causal, T))
                            cands = [default] + ([dict(w)] if w and w != default else [])
                        if own not in cands:
                            cands = [own] + cands
                        tried = []
                        for cfg in cands:
                            why = A.SPACE.why_invalid(cfg, p, dtype)
                            rec = {"config": cfg}
                            if why:
                                rec["error"] = f"invalid: {why}"
                                tried.append(rec)
                                continue
                            try:
                                cmp.poison(out)
                                A.attention(q, k, v, causal=causal, out=out, config=cfg)
                                torch.cuda.synchronize()
                                err = cmp.rel_error(out, want)
                                bad = cmp.unwritten(out, want)
                                rec["rel_err_vs_sdpa"] = err
                                if bad or not err <= 2 * cmp.tolerance(dtype):
                                    rec["error"] = f"mismatch: rel err {err:.2e}, {bad} unwritten"
                                else:
                                    rec["us"] = timed(lambda cfg=cfg: A.attention(q, k, v, causal=causal, out=out,
                                                                                 config=cfg))
                            except TimeoutError:
                                raise
                            except Exception as e:
                                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                            tried.append(rec)
                        for rnd in range(1, args.rounds):  # later rounds, alternating order: drift cancels
                            for rec in (tried[::-1] if rnd % 2 else tried):
                                if "us" in rec:
                                    t = timed(lambda cfg=rec["config"]: A.attention(q, k, v, causal=causal, out=out,
                                                                                   config=cfg))
                                    rec.setdefault("us_rounds", [rec["us"]]).append(t)
                                    rec["us"] = min(rec["us_rounds"])
                        row["sweep"] = tried
                        ok = [r for r in tried if "us" in r]
                        mine = next((r for r in tried if r["config"] == own and "us" in r), None)
                        row["ours_us"] = mine["us"] if mine else None
                        row["ours_config"] = own
                        if ok:
                            best = min(ok, key=lambda r: r["us"])
                            row["best_us"], row["best_config"] = best["us"], best["config"]
                            winners[(dname, D, causal, T)] = best["config"]
                            row["best_tflops"] = tfs(best["us"])
                            row["best_vs_sdpa"] = round(row["sdpa_us"] / best["us"], 3)
                        if mine:
                            row["ours_tflops"] = tfs(mine["us"])
                            row["ours_vs_sdpa"] = round(row["sdpa_us"] / mine["us"], 3)
                        row["sdpa_tflops"] = tfs(row["sdpa_us"])
                        _peer_ratios(row)
                        del q, k, v, out, want
                    except TimeoutError:
                        stopped = f"time budget of {args.budget_s:.0f} s spent"
                        row["skipped"] = stopped
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                        traceback.print_exc()
                    rows.append(row)
                    print(_line(row), flush=True)
                    if args.sweep in ("new", "gluon", "stages", "persistent", "wg3"):
                        for rec in row.get("sweep", []):
                            print("    " + _cand_line(rec, row), flush=True)
                    torch.cuda.empty_cache()

    summary = _summary(rows)
    wall_s = round(time.perf_counter() - t_start, 1)
    path = write_rows("attention_fa3_grid", rows, args.results, wall_s=wall_s, stopped=stopped,
                      environment=bench.environment(), summary=summary, command=" ".join(sys.argv))
    print(json.dumps(summary, indent=1))
    print(f"wrote {path} ({wall_s} s, commit {commit()})")
    if args.emit:
        print(f"store entries: {emit(rows, args.emit, A, dtypes)}")
    return 0


def _fa4_column(row: dict, q, k, v, causal: bool, want, timed, dtype) -> None:
    """flash-attn-4's forward (kernels.attention.peers.fa4_dense), checked against SDPA's output, then timed."""
    from types import SimpleNamespace

    from tritune.kernels.attention import peers as P
    from tritune.kernels.runtime import compare as cmp
    try:
        fn = P.fa4_dense(SimpleNamespace(args=(q, k, v), kwargs={"causal": causal}))
        if fn is None:
            row["fa4_us"], row["fa4_error"] = None, "flash-attn-4 not installed"
            return
        got = fn()
        got = got[0] if isinstance(got, tuple) else got   # (out, lse)
        err = cmp.rel_error(got.transpose(1, 2), want)
        row["fa4_rel_err_vs_sdpa"] = err
        if not err <= 2 * cmp.tolerance(dtype):
            row["fa4_us"], row["fa4_error"] = None, f"mismatch: rel err {err:.2e}"
            return
        row["fa4_us"] = timed(fn)
    except TimeoutError:
        raise
    except Exception as e:  # noqa: BLE001  (its compile or runtime refused this case: recorded)
        row["fa4_us"], row["fa4_error"] = None, f"{type(e).__name__}: {str(e)[:120]}"


def _peer_ratios(row: dict) -> None:
    """ours (the launcher's config) and best (the sweep's) against each FA3-class peer and the best of them."""
    peers = {n: row.get(f"{n}_us") for n in ("fa4", "sdpa_cudnn", "sdpa_flash")}
    peers = {n: t for n, t in peers.items() if t}
    if not peers:
        return
    best_peer = min(peers, key=peers.get)
    row["best_peer"], row["best_peer_us"] = best_peer, peers[best_peer]
    for who in ("ours", "best"):
        if row.get(f"{who}_us"):
            for n, t in peers.items():
                row[f"{who}_vs_{n}"] = round(t / row[f"{who}_us"], 3)
            row[f"{who}_vs_best_peer"] = round(peers[best_peer] / row[f"{who}_us"], 3)


def _line(r: dict) -> str:
    head = f"{r['dtype']} D={r['D']:3d} {'causal' if r['causal'] else 'full  '} T={r['T']:5d} B={r['B']:2d}"
    if "skipped" in r or "error" in r:
        return f"{head}  {r.get('skipped') or r.get('error')}"

    def us(x):
        return f"{x:8.1f}" if isinstance(x, (int, float)) else "       -"
    return (f"{head}  ours {us(r.get('ours_us'))} best {us(r.get('best_us'))} ({r.get('best_tflops', '-')} TF/s, "
            f"{r.get('best_vs_sdpa', '-')}x)  sdpa[{r.get('sdpa_backend')}] {us(r.get('sdpa_us'))}  "
            f"flash {us(r.get('sdpa_flash_us'))} eff {us(r.get('sdpa_efficient_us'))} "
            f"cudnn {us(r.get('sdpa_cudnn_us'))} fa4 {us(r.get('fa4_us'))}  ours/best-peer "
            f"{r.get('ours_vs_best_peer', '-')}x [{r.get('best_peer', '-')}]  best cfg {_short(r.get('best_config'))}")


def _cand_line(rec: dict, row: dict) -> str:
    """One candidate of a row: config, time (every round), speed against SDPA default, or why not timed."""
    if "us" not in rec:
        return f"{_short(rec['config']):44s} {rec.get('error', '?')[:110]}"
    rounds = "/".join(f"{t:.1f}" for t in rec.get("us_rounds", [rec["us"]]))
    vs = f"{row['sdpa_us'] / rec['us']:.3f}x" if row.get("sdpa_us") else "-"
    return f"{_short(rec['config']):44s} {rec['us']:8.1f} us ({rounds})  {vs} sdpa"


def _short(c) -> str:
    if not c:
        return "-"
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} hi{c['HEADS_INNER']} "
            f"tma{c['TMA']} {c['IMPL']}:{c['SCHEDULE']}{' persistent' if c['PERSISTENT'] else ''} "
            f"lazy{c['LAZY_RESCALE']}")


def _summary(rows: list[dict]) -> dict:
    out = {}
    for dname in sorted({r["dtype"] for r in rows}):
        rs = [r for r in rows if r["dtype"] == dname and "best_vs_sdpa" in r]
        if not rs:
            continue
        best = [r["best_vs_sdpa"] for r in rs]
        ours = [r["ours_vs_sdpa"] for r in rs if "ours_vs_sdpa" in r]
        d = {"points": len(rs), "best_vs_sdpa_min": min(best), "best_vs_sdpa_median": statistics.median(best),
             "ours_vs_sdpa_min": min(ours, default=None),
             "ours_vs_sdpa_median": statistics.median(ours) if ours else None,
             "points_below_1x": [f"D={r['D']} {'causal' if r['causal'] else 'full'} T={r['T']}"
                                 for r in rs if r["best_vs_sdpa"] < 1.0]}
        for n in ("fa4", "sdpa_cudnn", "best_peer"):
            vs = [r[f"ours_vs_{n}"] for r in rs if f"ours_vs_{n}" in r]
            if vs:
                d[f"ours_vs_{n}_median"], d[f"ours_vs_{n}_min"] = statistics.median(vs), min(vs)
                d[f"ours_vs_{n}_max"] = max(vs)
        d["points_below_best_peer"] = [f"D={r['D']} {'causal' if r['causal'] else 'full'} T={r['T']}"
                                       for r in rs if r.get("ours_vs_best_peer", 1.0) < 1.0]
        for causal, target in ((False, 600), (True, 560)):
            top = next((r for r in rs if r["D"] == 128 and r["T"] == 16384 and r["causal"] == causal), None)
            if top:
                d[f"d128_16k_{'causal' if causal else 'full'}_tflops"] = top["best_tflops"]
                d[f"d128_16k_{'causal' if causal else 'full'}_target"] = target
        d["targets_met"] = (d["best_vs_sdpa_min"] >= 1.0 and d["best_vs_sdpa_median"] >= 1.1
                            and d.get("d128_16k_full_tflops", 0) >= 600 and d.get("d128_16k_causal_tflops", 0) >= 560)
        out[dname] = d
    return out


def emit(rows: list[dict], root: Path, A, dtypes: dict) -> Path | None:
    """The winners as store entries (the tuner's entry shape) under root/<slug>/attention.json."""
    from tritune.kernels.runtime import store

    entries = []
    for r in rows:
        if "best_config" not in r or r.get("ours_us") is None:
            continue
        p = A.Problem(r["B"], r["H"], r["H"], r["T"], r["T"], r["D"], r["causal"])
        dtype = dtypes[r["dtype"]]
        default = A.default_config(p, dtype)
        entries.append({
            "bucket": store.bucket_key_of(A.SPEC, p), "dtype": store.dtype_name(dtype),
            "config": r["best_config"], "time_us": round(r["best_us"], 3),
            "default_us": next((round(t["us"], 3) for t in r["sweep"] if t["config"] == default and "us" in t), None),
            "default_config": default, "speedup": round(r["ours_us"] / r["best_us"], 3),
            "trials": len(r["sweep"]), "failed": sum("error" in t for t in r["sweep"]),
            "problem": f"B={p.B} Hq={p.Hq} Hkv={p.Hkv} Tq={p.Tq} Tk={p.Tk} D={p.D} causal={p.causal}",
            "study": "benchmarks/bench_attention_fa3_grid.py",
        })
    if not entries:
        return None
    return store.write(A.SPEC, entries, root=root)


if __name__ == "__main__":
    sys.exit(main())
