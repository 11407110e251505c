"""Probe: inductor compile time of a Hugging Face GPT-2, patched by tritune or not, against its depth.

    python lab/probes/hf_compile_time.py [--layers 2 4 8 12] [--what forward decode] [--variants hf tritune]
                                         [--limit 120] [--sample 5] [--out DIR]

Each (variant, what, layers) runs in a subprocess of its own under --limit seconds:
- forward: ``torch.compile(lambda ids: model(ids, use_cache=False).logits, fullgraph=True)``, ids (2, 8);
  the compile time is the first call's wall time less an eager call's.
- decode: transformers' static-cache recipe (``CompileConfig(fullgraph=True)``: generate runs the prefill
  eagerly, the decode steps through the compiled forward), 3 new tokens; the compile time is the first
  generate's wall time less an uncompiled generate's.
A watchdog thread samples the main thread's stack every --sample seconds while it compiles; a run that
passes half its limit prints the innermost frames it was seen in most (what the compile is stuck on).
Tiny width (n_embd 64, 2 heads, vocab 128), fp32, on whatever device there is (the CPU: kernels through
the Triton interpreter, inductor's C++ backend). Prints one line a run; --out writes JSON.
--as-211 builds inductor's implicit-fallback log text at every implicit fallback, as torch <= 2.11 does.

Found (2026-11-24, CPU, torch 2.13): without --as-211 every row compiles in 5-12 s at 2..16 layers, hf
and patched alike. With --as-211, before the ops were explicit inductor fallbacks (kernels/torch_ops.py
``inductor_fallbacks``), the patched forward took 5 s at 2 layers, 21 s at 3 and over 100 s at 4, the
samples all in exc.py operator_str <- LazyString.__str__ printing IR; after: 5 s at 4 layers, 7 s at
12 (forward), 11 s (decode).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
import traceback


def _format_fallback_logs() -> None:
    """Format inductor's "Creating implicit fallback for: <op and its args>" message, as torch <= 2.11 does
    at every implicit fallback (its ``log.info`` argument is an eager ``operator_str``; from 2.12 on a
    LazyString, built only when the INFO line is emitted). Here: built and dropped."""
    import logging

    class Format(logging.Handler):
        def emit(self, record):
            record.getMessage()

    log = logging.getLogger("torch._inductor.graph")
    log.setLevel(logging.INFO)
    log.addHandler(Format(logging.INFO))
    log.propagate = False


def _child(variant: str, what: str, layers: int, sample: float, limit: float, as_211: bool) -> dict:
    import tritune.harness  # noqa: F401  (the interpreter switch before triton loads)
    import torch
    import transformers

    from tritune.harness import device as dev
    from tritune.model import hf_patch

    if as_211:
        _format_fallback_logs()
    torch._inductor.config.fx_graph_cache = False  # time the compile, not a cache hit
    torch._inductor.config.autotune_local_cache = False
    device = dev.device()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=layers, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).to(device).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.disable_compile = True
    if variant == "tritune":
        hf_patch.patch(model)

    main = threading.main_thread().ident
    seen: collections.Counter = collections.Counter()
    stop = threading.Event()

    def watch():  # the innermost few frames of the main thread, counted per sample
        t0 = time.monotonic()
        while not stop.wait(sample):
            frame = sys._current_frames().get(main)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)[::-1]
            # the innermost frame, then the first three callers outside IR printing (who asked for it)
            outer = [f for f in stack[1:] if os.path.basename(f.filename) not in ("ir.py", "textwrap.py")][:3]
            seen[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack[:1] + outer)] += 1
            if time.monotonic() - t0 > limit / 2 and sum(seen.values()) == int(limit / 2 / sample) + 1:
                print("stuck? most seen:", *seen.most_common(3), sep="\n  ", file=sys.stderr, flush=True)

    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        if what == "forward":
            fn = lambda x: model(x, use_cache=False).logits  # noqa: E731
            t0 = time.perf_counter()
            fn(ids)
            eager = time.perf_counter() - t0
            compiled = torch.compile(fn, fullgraph=True, backend="inductor")
        else:
            from transformers import CompileConfig

            kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static")
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            eager = time.perf_counter() - t0
            cc = CompileConfig(fullgraph=True, backend="inductor", mode=None)
            cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
            model.generation_config.compile_config = cc
            model.generation_config.disable_compile = False
            compiled = lambda x: model.generate(x, **kw)  # noqa: E731
        threading.Thread(target=watch, daemon=True).start()
        t0 = time.perf_counter()
        compiled(ids)
        first = time.perf_counter() - t0
        stop.set()
    return {"variant": variant, "what": what, "layers": layers, "as_211": as_211, "compile_s": first - eager, "first_s": first,
            "eager_s": eager, "graphs": torch._dynamo.utils.counters["stats"].get("unique_graphs", 0),
            "top_frames": seen.most_common(3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 12])
    ap.add_argument("--what", nargs="+", choices=("forward", "decode"), default=["forward", "decode"])
    ap.add_argument("--variants", nargs="+", choices=("hf", "tritune"), default=["hf", "tritune"])
    ap.add_argument("--limit", type=float, default=120.0, help="seconds for one run")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between stack samples")
    ap.add_argument("--out", help="directory for hf_compile_time.json")
    ap.add_argument("--as-211", action="store_true",
                    help="format inductor's implicit-fallback INFO message as torch <= 2.11 always does")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        v, w, n = args.child
        print("RESULT " + json.dumps(_child(v, w, int(n), args.sample, args.limit, args.as_211)), flush=True)
        return 0
    rows = []
    for what in args.what:
        for variant in args.variants:
            for n in args.layers:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, what, str(n),
                       "--sample", str(args.sample), "--limit", str(args.limit)] + (["--as-211"] if args.as_211 else [])
                t0 = time.perf_counter()
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
                    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                    row = json.loads(lines[-1][7:]) if lines else {
                        "variant": variant, "what": what, "layers": n, "error": p.stderr[-1500:]}
                except subprocess.TimeoutExpired as e:
                    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
                    row = {"variant": variant, "what": what, "layers": n,
                           "error": f"over {args.limit:.0f} s", "stderr": err[-3000:]}
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print(f"{what:8s} {variant:8s} L={n:3d} compile {row.get('compile_s', float('nan')):8.1f} s"
                      f"  (wall {row['wall_s']:.0f} s) {row.get('error', '')[:200]}", flush=True)
                if "stderr" in row:
                    print(row["stderr"][-1500:])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hf_compile_time.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
