"""Prefix caching, chunked prefill and speculative decoding on the GPU, each against its baseline (bounded).

  python lab/bench_serving_features.py OUTDIR [--model DIR] [--draft DIR] [--time-limit 240] [--smoke]

Three ``tritune serve-bench --workload`` runs (triton backend, CUDA graphs, bf16), each in its own process
under its share of ``--time-limit``; each writes OUTDIR/serving_<workload>_<date>_<commit>.json, and a
summary (targets met or not) goes to OUTDIR/serving_features_<date>_<commit>.json:

1. shared-prefix: 512 requests, a 192-token common prefix + 16-64 token suffixes, 128 output tokens, all
   arriving at once (GPT-2 small's config, random weights, unless ``--model``); prefix cache on vs off.
   Targets: >= 70% fewer prefill tokens computed, >= 1.5x output tok/s.
2. mixed: 32 requests decoding (64-token prompts) while 4 long prompts arrive (2048 tokens, capped at
   the context: GPT-2's 1024 positions allow 1020); inter-token latency of the decoding requests, one
   step per host sync (``decode_steps=1``), unchunked vs chunked (512 tokens per step). Target: chunked
   P99 <= 2x the decode-only P50.
3. speculative: batch 1 on the packaged model (``model/default``, or ``--spec-model``), 4 prompts of 64
   tokens, 128 new tokens each; plain (CUDA-graph decode) vs n-gram lookup and a draft (``--draft``, a
   checkpoint sharing the tokenizer; else the target's first 2 layers as an early-exit draft): acceptance
   rate and tok/s. Target: >= 1.5x. Speculative steps run eagerly (the decode graph holds one query row
   per sequence), so they must win back the graph's advantage first.

``--smoke``: tiny sizes on the CPU (the torch backend), to check the driver runs end to end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*a) -> str:
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def runs(args):
    default_model = str(ROOT / "model" / "default")
    common = ["--max-num-seqs", "256", "--block-size", "16", "-q"]
    model = ["--model", args.model] if args.model else []
    if args.smoke:      # the packaged model (7 layers, 256 wide): seconds on the CPU
        model = ["--model", args.model or default_model]
        return {
            "shared-prefix": ["--workload", "shared-prefix", "-n", "8", "--prefix-len", "32", "--prompt-len", "4:8",
                              "--output-len", "4", "--modes", "torch", *model],
            "mixed": ["--workload", "mixed", "-n", "4", "--long-prompt", "200", "--long-prompts", "2",
                      "--output-len", "40", "--chunk", "64", "--modes", "torch", *model],
            "speculative": ["--workload", "speculative", "-n", "1", "--prompt-len", "16", "--output-len", "16",
                            "--modes", "torch", "--model", args.spec_model or default_model, "--draft-layers", "2"],
        }
    spec = ["--model", args.spec_model or default_model]
    spec += ["--draft", args.draft] if args.draft else ["--draft-layers", "2"]
    return {
        "shared-prefix": ["--workload", "shared-prefix", "-n", "512", "--prefix-len", "192", "--prompt-len", "16:64",
                          "--output-len", "128", "--modes", "triton-graphs", *common, *model],
        "mixed": ["--workload", "mixed", "-n", "32", "--long-prompt", "2048", "--long-prompts", "4",
                  "--output-len", "256", "--chunk", "512", "--modes", "triton-graphs", *common, *model],
        "speculative": ["--workload", "speculative", "-n", "4", "--prompt-len", "64", "--output-len", "128",
                        "--spec-k", "4", "--modes", "triton-graphs", *common, *spec],
    }


def summarize(results: dict) -> dict:
    out = {}
    sp = results.get("shared-prefix", {}).get("results")
    if sp:
        out["shared_prefix"] = {"prefill_token_reduction": sp["prefill_token_reduction"],
                                "output_tok_s_speedup": sp["output_tok_s_speedup"],
                                "ttft_p50_ms": {k: sp[k]["ttft_ms"]["p50"] for k in ("cache_off", "cache_on")},
                                "ttft_p99_ms": {k: sp[k]["ttft_ms"]["p99"] for k in ("cache_off", "cache_on")},
                                "met": sp["prefill_token_reduction"] >= 0.7 and sp["output_tok_s_speedup"] >= 1.5}
    mx = results.get("mixed", {}).get("results")
    if mx:
        out["mixed"] = {k: {"decode_only_p50_ms": mx[k]["itl_decode_only_ms"]["p50"],
                            "p99_with_long_prompts_ms": mx[k]["itl_with_long_prompts_ms"]["p99"],
                            "ratio": mx[k]["p99_over_decode_p50"]} for k in ("unchunked", "chunked")}
        r = mx["chunked"]["p99_over_decode_p50"]
        out["mixed"]["met"] = r is not None and r <= 2.0
    spc = results.get("speculative", {}).get("results")
    if spc:
        out["speculative"] = {k: {kk: v.get(kk) for kk in ("decode_tok_s", "acceptance_rate", "speedup",
                                                            "outputs_equal_plain")} for k, v in spc.items()}
        out["speculative"]["met"] = any((v.get("speedup") or 0) >= 1.5 for v in spc.values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--model", default=None, help="shared-prefix and mixed (default GPT-2 small, random weights)")
    ap.add_argument("--spec-model", default=None, help="speculative target (default model/default)")
    ap.add_argument("--draft", default=None, help="speculative draft checkpoint sharing the target's tokenizer")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for all three runs")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{datetime.date.today().isoformat()}_{_git('rev-parse', '--short', 'HEAD') or 'nogit'}"
    share = {"shared-prefix": 0.4, "mixed": 0.3, "speculative": 0.3}
    results, status = {}, {}
    t_all = time.perf_counter()
    for name, cli in runs(args).items():
        path = out / f"serving_{name.replace('-', '_')}_{tag}.json"
        cmd = [sys.executable, "-m", "tritune.harness.cli", "serve-bench", *cli, "--out", str(path)]
        left = args.time_limit - (time.perf_counter() - t_all)
        limit = max(10.0, min(left, share[name] * args.time_limit + max(0.0, left - args.time_limit * sum(
            v for k, v in share.items() if k not in results and k != name) - share[name] * args.time_limit)))
        print(f"[{name}] {' '.join(cmd[3:])} (limit {limit:.0f} s)", flush=True)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=limit, cwd=ROOT)
            status[name] = {"rc": p.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        except subprocess.TimeoutExpired:
            status[name] = {"rc": None, "timed_out": True, "seconds": round(time.perf_counter() - t0, 1)}
        if path.exists():
            results[name] = json.loads(path.read_text())
    summary = {"date": datetime.date.today().isoformat(), "commit": _git("rev-parse", "HEAD"), "runs": status,
               "summary": summarize(results)}
    (out / f"serving_features_{tag}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["summary"], indent=2))
    return 0 if all(s.get("rc") == 0 for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
