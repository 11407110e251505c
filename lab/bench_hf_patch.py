"""GPU driver: Hugging Face GPT-2 (small config, random init, bf16) with and without tritune.patch.

    python lab/bench_hf_patch.py RESULTS_DIR [--part generate|prefill|step|all] [--batches 32 1] [--new 128]
                                 [--prompt 64] [--reps 3] [--time-limit 280] [--variant-limit 150]
                                 [--smoke [--smoke-backend aot_eager|inductor] [--smoke-layers 2]]
                                 [--compiled-only] [--profile] [--stub-kernels]

generate: static cache, batch 32 then 1: HF, HF + torch.compile, patched, patched + torch.compile. The
compiled rows are transformers' own recipe for a static cache: ``generation_config.compile_config =
CompileConfig(fullgraph=True, mode="reduce-overhead")``, with which ``generate`` runs the prefill eagerly
(the StaticCache allocates its tensors there and marks their addresses static) and the decode steps
through the compiled forward. Compiling ``model.forward`` by hand instead puts the prefill, and so the
cache's allocation, inside the first CUDA graph: the next replay overwrites it ("accessing tensor output
of CUDAGraphs that has been overwritten by a subsequent run"). tok/s = batch x new tokens / wall time of
one generate (median of --reps, after a warm-up generate that compiles and records the graphs); each row
says whether the compiled call ran and how many CUDA-graph skips inductor counted.
prefill: 8 x 1024 tokens, one forward without a cache: patched (eager and compiled), HF eager attention,
HF sdpa eager, HF sdpa under torch.compile; median ms over CUDA-event-timed reps; and the patched
model's logits against HF's (float64 HF as the reference).

Every row records compile_s (torch.compile's own total: dynamo + AOT + inductor, from
torch._dynamo.utils.calculate_time_spent after the row's reset; also for a row that failed or timed out)
beside its warm-up (generate) or first-call (prefill) wall time, and the summary prints both.

The target pair (batch 32 compiled) runs first. Every measurement runs in its own try/except under its
own time limit (SIGALRM): a failure or a timeout is recorded and the rest still run, until --time-limit
is spent (later rows are then recorded as skipped). The JSON, RESULTS_DIR/hf_patch_<part>_<date>_<commit>.json,
is rewritten after every row, so a run killed from outside keeps what it measured.
step (``--part step``): the compiled decode call alone, HF and patched (``bench_step``): its host time
without a sync, with one, its device span between CUDA events, dynamo's guard lookup, the compiled
region, HF's loop a step; and the decode graph's inputs (static), outputs and guard-tree lines. Where a
step's host time (no sync) matches HF's but its synced time does not, the extra is the graph's span on
the device (gaps between kernels: the profile's busy time leaves them out), not host work. --smoke
--smoke-backend inductor --stub-kernels measures the host side on the CPU (empty launchers).
Found (2026-11-24, CPU, torch 2.13, transformers 5.24, 12 tiny layers, a loaded 2-core machine): the
decode graph has 187 inputs (184 static: only input_ids, position_ids and the mask are copied a replay)
and 1 output, patched and not; guard-tree lines 2958 patched vs 3599; host time outside the graph call
185-595 us patched vs 365-796 us HF; HF's loop a step (prefill share included) no higher patched. The
patched step's only extra CPU time is inside the graph call (the ops' dispatch, ~15 us an op), which a
CUDA-graph replay does not run. So the H100's +1.1 ms a step is not host work this side can see:
measure host_us against step_us and device_us on the GPU.
--profile: each generate row runs one more generate under torch.profiler and records, per decode step,
the device's busy time, kernels and CUDA-graph launches, and the top kernels (the GPU work a compiled
step replays against the host time around it). --compiled-only: only the two compiled rows.
Target: patched + compile >= 1.3x HF + compile at batch 32.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback

import tritune.harness  # noqa: F401  (the interpreter switch, --smoke on the CPU, before triton loads)
import torch

# --smoke (the CPU, through the Triton interpreter): a tiny GPT-2 in fp32, compiled rows on aot_eager; it
# checks the driver's paths, not speed
SMOKE = {"on": False, "config": dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2),
         "backend": "aot_eager"}
VOCAB = 50257


def _dev():
    return "cpu" if SMOKE["on"] else "cuda"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        return "unknown"


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": "".join(traceback.format_exception(e)[-6:])[-4000:]}


def _compile_s() -> float:
    """Seconds torch.compile spent (dynamo + AOT + inductor, all frames) since the last
    ``torch._dynamo.reset()``, which every row starts with: its compile time."""
    try:
        return round(torch._dynamo.utils.calculate_time_spent().get("total_wall_time", 0.0), 2)
    except Exception:  # pragma: no cover - a torch without the counter
        return float("nan")


class RowTimeout(Exception):
    pass


@contextlib.contextmanager
def _limit(seconds: float):
    """Raise RowTimeout in the main thread after ``seconds`` (a row that hangs in a compile or a loop)."""
    def fire(signum, frame):
        raise RowTimeout(f"row over its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _model(attn="sdpa"):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**(SMOKE["config"] if SMOKE["on"] else {}))
    dtype = torch.float32 if SMOKE["on"] else torch.bfloat16
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(_dev(), dtype).eval()
    m.generation_config.pad_token_id = 0
    m.generation_config.disable_compile = True  # no automatic compile unless a row asks for it
    return m


def _variant(base, patched: bool, compiled: bool):
    """A copy of ``base``, patched or not; ``compiled``: generate compiles its decode steps
    (transformers' CompileConfig, see the module docstring)."""
    from tritune.model import hf_patch

    m = copy.deepcopy(base)
    if patched:
        hf_patch.patch(m)
    if compiled:
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        if SMOKE["on"]:
            cc = CompileConfig(fullgraph=True, backend=SMOKE["backend"], mode=None)
            cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
        m.generation_config.compile_config = cc
        m.generation_config.disable_compile = False
    return m


@torch.no_grad()
def bench_generate(model, batch: int, prompt: int, new: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, VOCAB, (batch, prompt), generator=g).to(_dev())
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    skips0 = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
    t0 = time.perf_counter()
    model.generate(ids, **kw)  # warm-up: compiles, records the graphs, fills the tuned-config caches
    _sync()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync()
        times.append(time.perf_counter() - t0)
    made = out.shape[1] - prompt
    s = statistics.median(times)
    return {"batch": batch, "prompt": prompt, "new_tokens": made, "s": s, "tok_s": batch * made / s,
            "ms_per_step": s / made * 1e3, "runs_s": times, "warmup_s": warm_s,
            "compiled_call": hasattr(model, "_compiled_call"), "compile_s": _compile_s(),
            "cudagraph_skips": torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0) - skips0,
            **({"profile": profile_generate(model, ids, kw, made)} if PROFILE["on"] else {})}


PROFILE = {"on": False, "top": 12}


def profile_generate(model, ids, kw, steps: int) -> dict:
    """One more generate under torch.profiler: per decode step, the device's busy time (sum of kernel and
    memcpy/memset times), the kernels launched, the CUDA-graph launches, and the top kernels by time. A
    step whose device time is far below its wall time is host-bound; kernels >> graph launches x the
    graph's kernels means the step is not replayed from a graph."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        model.generate(ids, **kw)
        _sync()
    wall = time.perf_counter() - t0
    kern: dict = {}
    graph_launches = 0
    for e in prof.events():
        if e.name in ("cudaGraphLaunch", "cuGraphLaunch"):
            graph_launches += 1
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            t, n = kern.get(e.name, (0.0, 0))
            kern[e.name] = (t + e.device_time, n + 1)  # us (the event's own kernel time)
    busy = sum(t for t, _ in kern.values())
    top = sorted(kern.items(), key=lambda kv: -kv[1][0])[:PROFILE["top"]]
    return {"steps": steps, "wall_ms_per_step": wall / steps * 1e3, "device_ms_per_step": busy / steps / 1e3,
            "kernels_per_step": sum(n for _, n in kern.values()) / steps,
            "graph_launches_per_step": graph_launches / steps,
            "top": [{"name": k[:100], "us_per_step": t / steps, "per_step": n / steps} for k, (t, n) in top]}


# --- --part step: one compiled decode step, host against device -------------------------------------
def stub_kernels() -> None:
    """--smoke --stub-kernels: the launchers return empty outputs of the right shape (the CPU's host cost of
    the patched step without the Triton interpreter's; what a CUDA-graph replay skips anyway)."""
    from tritune.kernels import attention, gemm, gemv, layer_norm, paged_attention

    gemv.gemv = lambda x, w, bias=None, **k: x.new_empty((*x.shape[:-1], w.shape[1]))
    gemm.gemm = lambda a, b, bias=None, **k: a.new_empty((*a.shape[:-1], b.shape[1]))
    layer_norm.layer_norm = lambda x, *a, **k: torch.empty_like(x)
    paged_attention.paged_attention = lambda q, *a, **k: torch.empty_like(q)
    attention.attention = lambda q, *a, **k: torch.empty_like(q)


class _GraphCounts:
    """A recording backend (the graph runs as traced): the decode graph's inputs as dynamo hands them over
    (placeholders; static ones are parameters, buffers and addresses marked static, which CUDA-graph
    trees check by pointer; the others are copied into the graph's buffers every replay) and outputs."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        static = sum(isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) is not None
                     for x in example_inputs if isinstance(x, torch.Tensor))
        self.graphs.append({"inputs": len(ph), "static_inputs": static, "non_static_inputs": len(ph) - static,
                            "outputs": len(out) if isinstance(out, (tuple, list)) else 1})
        return gm.forward


def _guard_lines() -> int:
    """Guard-tree lines (one a guard or a guard manager) over every frame dynamo compiled since the reset."""
    import gc

    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    n = 0
    seen = set()
    for o in gc.get_objects():
        try:
            if type(o) is not type(_guard_lines) or o.__code__ in seen:
                continue
            seen.add(o.__code__)
            for e in _debug_get_cache_entry_list(o.__code__):
                n += sum(1 for ln in str(e.guard_manager).splitlines() if ln.strip())
        except Exception:  # a weakly referenced object that went away while we walked
            continue
    return n


@torch.no_grad()
def bench_step(model, batch: int, prompt: int, new: int, reps: int) -> dict:
    """transformers' compiled static-cache recipe: a warm-up generate (compiles, records the graph), then
    the compiled decode call alone, called again and again with the last step's arguments (the caches'
    write positions put back before each call, outside the timing):
    - host_us: the call without a sync (guards, AOT wrappers, the replay's launch: the host's share),
    - step_us: the call then a sync (what generate's loop waits for: it syncs on every step),
    - device_us (CUDA): CUDA events around the call: the step's span on the device, gaps included,
    - guard_us / region_us (profiler): dynamo's cache lookup and the compiled region a call,
    - loop_us: a generate's wall time a step less its compiled calls (HF's loop, the prefill's share).
    and the graph's counts (inputs, static inputs, outputs, guard-tree lines)."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, VOCAB, (batch, prompt), generator=g).to(_dev())
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    # the counts from a trace of its own (a recording backend), the timings from transformers' own recipe
    counts = _GraphCounts()
    model._last_compile_config = model.generation_config.compile_config
    model._compiled_call = torch.compile(model.__call__, fullgraph=True, backend=counts)
    model.generate(ids, **dict(kw, max_new_tokens=3, min_new_tokens=3))
    del model._compiled_call, model._last_compile_config
    torch._dynamo.reset()
    model.generate(ids, **kw)  # compiles, records the CUDA graph
    compiled, last, spent = model._compiled_call, {}, [0.0, 0]

    def recorder(*a, **k):
        cache = k.get("past_key_values", k.get("cache"))
        # where a layer counts its writes (transformers >= 5.2x: cumulative_length), the count is put back
        # before each timed call; older layers write at the cache_position argument, the same every call
        pos = [(lay, lay.cumulative_length.clone()) for lay in getattr(cache, "layers", ())
               if isinstance(getattr(lay, "cumulative_length", None), torch.Tensor)]
        last.update(a=a, k=k, pos=pos)
        t0 = time.perf_counter()
        r = compiled(*a, **k)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return r

    model._compiled_call = recorder
    _sync()
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    _sync()
    gen_s = time.perf_counter() - t0
    loop_us = (gen_s - spent[0]) / max(1, spent[1]) * 1e6
    a, k, pos = last["a"], last["k"], last["pos"]

    def reset():
        for lay, p in pos:
            lay.cumulative_length.copy_(p)

    def call():
        out = compiled(*a, **k)
        del out

    n = 20 if SMOKE["on"] else 200
    for _ in range(5):
        reset()
        call()
    host, step, dev, inner, gcall = [], [], [], [0.0], []
    cuda = torch.cuda.is_available() and not SMOKE["on"]
    # the compiled graph's own call (inductor's program; with CUDA graphs the tree's replay: input copies,
    # pointer checks, the launch) timed inside the call, so host - graph_call is what wraps it: dynamo's
    # guards, the AOT wrappers, the side effects replayed after the graph
    from torch._inductor.output_code import CompiledFxGraph

    graph_call = CompiledFxGraph.__call__

    def timed_graph_call(self, inputs):
        t = time.perf_counter()
        try:
            return graph_call(self, inputs)
        finally:
            inner[0] += time.perf_counter() - t

    CompiledFxGraph.__call__ = timed_graph_call
    try:
        for _ in range(n):
            reset()
            _sync()
            t0 = time.perf_counter()
            inner[0] = 0.0
            call()
            host.append(time.perf_counter() - t0)
            gcall.append(inner[0])
            _sync()
            step.append(time.perf_counter() - t0)
    finally:
        CompiledFxGraph.__call__ = graph_call
    for _ in range(n if cuda else 0):
        reset()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync()
        e0.record()
        call()
        e1.record()
        e1.synchronize()
        dev.append(e0.elapsed_time(e1) * 1e-3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            reset()
            call()
        _sync()
    ev = {e.key: e for e in prof.key_averages()}
    # where the host's share goes, function by function (cProfile, 100 calls, synced after each)
    import cProfile
    import io
    import pstats

    cp = cProfile.Profile()
    for _ in range(5 if SMOKE["on"] else 100):
        reset()
        cp.enable()
        call()
        cp.disable()
        _sync()
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(40)
    host_functions = buf.getvalue()

    def per_call(name):
        hit = [e for key, e in ev.items() if key.startswith(name)]
        return sum(e.cpu_time_total for e in hit) / 20 if hit else None

    med = statistics.median
    return {"batch": batch, "host_us": med(host) * 1e6, "graph_call_us": med(gcall) * 1e6,
            "outside_graph_us": med([h - g for h, g in zip(host, gcall)]) * 1e6, "step_us": med(step) * 1e6,
            "device_us": med(dev) * 1e6 if dev else None, "loop_us": loop_us,
            "generate_ms_per_step": gen_s / max(1, spent[1] + 1) * 1e3,
            "guard_us": per_call("TorchDynamo Cache Lookup"), "region_us": per_call("Torch-Compiled Region"),
            "graph_us": per_call("## Call CompiledFxGraph"), "graphs": counts.graphs,
            "guard_lines": _guard_lines(), "calls": n, "host_functions_100_calls": host_functions}


@torch.no_grad()
def bench_prefill(fn, ids, reps: int) -> dict:
    t0 = time.perf_counter()
    fn(ids)  # a compiled fn compiles here
    _sync()
    first_s = time.perf_counter() - t0
    for _ in range(0 if SMOKE["on"] else 2):
        fn(ids)
    ms = []
    for _ in range(reps):
        if SMOKE["on"]:  # no CUDA events on the CPU
            t0 = time.perf_counter()
            fn(ids)
            ms.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(ids)
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return {"ms": statistics.median(ms), "runs_ms": ms, "tok_s": ids.numel() / statistics.median(ms) * 1e3,
            "first_s": first_s, "compile_s": _compile_s()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--part", choices=("generate", "prefill", "step", "all"), default="all")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 1])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", type=int, nargs=2, default=[8, 1024], metavar=("B", "T"))
    ap.add_argument("--time-limit", type=float, default=280.0, help="seconds for the whole run")
    ap.add_argument("--variant-limit", type=float, default=150.0, help="seconds for one row")
    ap.add_argument("--smoke", action="store_true", help="the CPU: a tiny model through the interpreter")
    ap.add_argument("--smoke-backend", choices=("aot_eager", "inductor"), default="aot_eager",
                    help="--smoke's compiled generate rows (inductor: its C++ backend, the real lowering)")
    ap.add_argument("--smoke-layers", type=int, default=2, help="--smoke's model depth")
    ap.add_argument("--profile", action="store_true",
                    help="generate rows: one more generate under torch.profiler (device time per step, top kernels)")
    ap.add_argument("--compiled-only", action="store_true", help="generate: only the two compiled rows")
    ap.add_argument("--stub-kernels", action="store_true",
                    help="--smoke: the launchers return empty outputs (host cost without the interpreter's)")
    args = ap.parse_args(argv)
    PROFILE["on"] = args.profile
    if args.smoke:
        global VOCAB
        SMOKE["on"], VOCAB, SMOKE["backend"] = True, SMOKE["config"]["vocab_size"], args.smoke_backend
        SMOKE["config"]["n_layer"] = args.smoke_layers
        # --part step keeps up to 48 new tokens (its loop_us: HF's loop a step, not the prefill's share)
        new = min(args.new, 48) if args.part == "step" else 3
        args.batches, args.prompt, args.new, args.reps, args.prefill = [2], 5, new, 1, [2, 16]
        if args.stub_kernels:
            stub_kernels()
    elif not torch.cuda.is_available():
        print("bench_hf_patch: needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.time_limit
    os.makedirs(args.out_dir, exist_ok=True)
    import transformers
    import triton

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    res = {"date": datetime.date.today().isoformat(), "commit": _commit(),
           "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "model": "GPT-2 small config, random init, bf16", "args": vars(args), "generate": {}, "prefill": {},
           "step": {}, "checks": {}}
    path = os.path.join(args.out_dir, f"hf_patch_{args.part}_{res['date']}_{res['commit']}.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    def row(table, key, fn):
        """fn() under the row limit and the run's deadline; its dict, or its error, into res[table][key]."""
        left = deadline - time.monotonic()
        if left < 15:
            res[table][key] = {"error": "skipped: --time-limit spent"}
        else:
            torch._dynamo.reset()
            try:
                with _limit(min(args.variant_limit, left)):
                    res[table][key] = fn()
            except Exception as e:
                res[table][key] = _error(e)
            if isinstance(res[table][key], dict) and "error" in res[table][key]:
                res[table][key]["compile_s"] = _compile_s()  # how far a compile that failed or timed out got
            with contextlib.suppress(Exception):  # a row that broke the CUDA context must not end the run here
                _sync()
                torch.cuda.empty_cache()
        save()
        v = res[table][key]
        shown = ("tok_s", "ms", "compile_s", "warmup_s", "first_s", "compiled_call", "error")
        print(table, key, {k: v[k] for k in shown if k in v}, flush=True)

    base = _model()
    if args.part in ("generate", "all"):
        order = [(b, n, p, c) for b in args.batches for c in ((True,) if args.compiled_only else (True, False))
                 for n, p in (("hf", False), ("tritune", True))]
        for b, name, patched, compiled in order:
            key = f"{name}{'+compile' if compiled else ''} b={b}"
            row("generate", key, lambda: bench_generate(_variant(base, patched, compiled), b, args.prompt,
                                                        args.new, args.reps))

    if args.part in ("step", "all"):
        for b in args.batches:
            for name, patched in (("hf", False), ("tritune", True)):
                row("step", f"{name}+compile b={b}",
                    lambda: bench_step(_variant(base, patched, True), b, args.prompt, args.new, args.reps))

    if args.part in ("prefill", "all"):
        def check():  # the patched model's logits against HF's (bf16 both, float64 HF as the reference)
            from tritune.harness import compare as cmp

            ids = torch.randint(1, VOCAB, (2, 16 if SMOKE["on"] else 128),
                                generator=torch.Generator().manual_seed(3)).to(_dev())
            with torch.no_grad():
                ref = copy.deepcopy(base).double()(ids).logits
                got = _variant(base, True, False)(ids).logits
                hf = base(ids).logits
            return {"patched_rel_err": cmp.rel_error(got, ref), "hf_bf16_rel_err": cmp.rel_error(hf, ref),
                    "tol_bf16": cmp.tolerance(torch.bfloat16)}

        row("checks", "logits", check)
        B, T = args.prefill
        ids = torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(4)).to(_dev())

        def fwd(m):
            return lambda x: m(x, use_cache=False).logits

        prefill = (("tritune", lambda: fwd(_variant(base, True, False))),
                   ("tritune+compile", lambda: torch.compile(fwd(_variant(base, True, False)), fullgraph=True)),
                   ("hf eager-attention", lambda: fwd(_model("eager"))),
                   ("hf sdpa", lambda: fwd(base)),
                   ("hf sdpa+compile", lambda: torch.compile(fwd(base), fullgraph=True)))
        for name, make in prefill:
            row("prefill", name, lambda: bench_prefill(make(), ids, 1 if args.smoke else max(args.reps, 10)))

    # ratios (the targets)
    g, p = res["generate"], res["prefill"]
    ratios = {}
    for b in args.batches:
        for a, c in (("tritune+compile", "hf+compile"), ("tritune", "hf")):
            x, y = g.get(f"{a} b={b}", {}), g.get(f"{c} b={b}", {})
            if "tok_s" in x and "tok_s" in y:
                ratios[f"{a} / {c} b={b}"] = x["tok_s"] / y["tok_s"]
    for a in ("tritune", "tritune+compile"):
        for c in ("hf eager-attention", "hf sdpa", "hf sdpa+compile"):
            if "ms" in p.get(a, {}) and "ms" in p.get(c, {}):
                ratios[f"prefill {a} vs {c} (speedup)"] = p[c]["ms"] / p[a]["ms"]
    res["ratios"] = ratios
    x = ratios.get("tritune+compile / hf+compile b=32")
    res["target_batch32_1.3x"] = None if x is None else x >= 1.3
    save()
    if g:
        print("\ngenerate (static cache)        tok/s   ms/step  compile s  warm-up s")
        for k, v in g.items():
            print(f"  {k:28s} {v.get('tok_s', float('nan')):9.1f} {v.get('ms_per_step', float('nan')):8.3f} "
                  f"{v.get('compile_s', float('nan')):10.1f} {v.get('warmup_s', float('nan')):10.1f}  "
                  f"{v.get('error', '')[:90]}")
    if p:
        print(f"prefill {args.prefill[0]} x {args.prefill[1]}               ms  compile s  first call s")
        for k, v in p.items():
            print(f"  {k:28s} {v.get('ms', float('nan')):9.3f} {v.get('compile_s', float('nan')):10.1f} "
                  f"{v.get('first_s', float('nan')):13.1f}  {v.get('error', '')[:90]}")
    for k, v in g.items():
        pr = v.get("profile")
        if pr:
            print(f"profile {k}: wall {pr['wall_ms_per_step']:.3f} ms/step, device {pr['device_ms_per_step']:.3f} ms/step, "
                  f"{pr['kernels_per_step']:.0f} kernels/step, {pr['graph_launches_per_step']:.2f} graph launches/step")
            for t in pr["top"][:8]:
                print(f"    {t['us_per_step']:8.1f} us {t['per_step']:5.1f}x  {t['name'][:80]}")
    if res["step"]:
        print("compiled decode step (us)     host  g.call outside  step  device | profiler: guards region graph |"
              "  loop  inputs(static) outputs guard-lines")
        for k, v in res["step"].items():
            if "error" in v:
                print(f"  {k:24s} {v['error'][:100]}")
                continue
            gr = v["graphs"][-1] if v["graphs"] else {}
            f = lambda x: "     -" if x is None else f"{x:6.0f}"  # noqa: E731
            print(f"  {k:24s} {f(v['host_us'])} {f(v['graph_call_us'])}  {f(v['outside_graph_us'])} {f(v['step_us'])} "
                  f"{f(v['device_us'])} |          {f(v['guard_us'])} {f(v['region_us'])} {f(v['graph_us'])} | "
                  f"{f(v['loop_us'])}  {gr.get('inputs')}({gr.get('static_inputs')})       {gr.get('outputs')}      "
                  f"{v['guard_lines']}")
    for k, v in ratios.items():
        print(f"  {k:45s} {v:6.2f}x")
    if "target_batch32_1.3x" in res and res["target_batch32_1.3x"] is not None:
        print("target batch 32 >= 1.3x:", res["target_batch32_1.3x"])
    if res["checks"]:
        c = res["checks"].get("logits", {})
        print("checks", c.get("error", c))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
