"""GPU driver: Hugging Face GPT-2 (small config, random init, bf16) with and without tritune.patch.

    python benchmarks/bench_hf_patch.py [--results DIR] [--part floor,generate,prefill,step,genprof,all (a comma list)]
                                        [--batches 32 1] [--new 128] [--prompt 64] [--reps 3] [--time-limit 280] [--variant-limit 150]
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
model's logits against HF's (float64 HF as the reference). Each row also records host_ms (the call's
time until it returns, every launch queued: near ms means host-bound). Rows added to find why patched +
compile was slower than patched eager (H100, e9041e3: 10.32 against 8.38 ms): the compiled patched
prefill under inference_mode (the dispatcher skips the custom ops' Python autograd layer), both compiled
models under mode="reduce-overhead" (a CUDA-graph replay: no host work, ms is the kernels' own time),
and ``dispatch`` (``bench_dispatch``): one op's host cost as eager calls it and through torch.ops.
Found on the CPU (2026-11-25, inductor, tests/test_hf_patch.py::test_compiled_prefill_launches_what_
eager_launches): the compiled prefill launches what eager does and no more (5 tritune ops a layer, q/k/v
as views, one transpose kernel a layer, no aten fallback, copy or mask). What it adds is host time: each
of its 62 ops (12 layers) goes through the dispatcher and custom_op's Python layers (autograd_impl,
redispatch, backend_impl, a dynamo-disable wrapper): 13-17 us a call against 2.7-3.6 for the body eager
calls (torch_ops.EAGER), 7.4 under inference_mode; plus dynamo's guards a call. With stub kernels
(--smoke --stub-kernels, 12 layers, best of 5 x 300 calls) a forward's host time was 979 us eager
against 1440 compiled (no_grad), 866 against 978 (inference_mode). Eager patched at 8 x 1024 issues ~100
launches whose kernels are short (GPT-2 small: tens of us each), so its host time is close to its
device time and any host work the compiled graph adds shows up as wall time.

Every row records compile_s (torch.compile's own total: dynamo + AOT + inductor, from
torch._dynamo.utils.calculate_time_spent after the row's reset; also for a row that failed or timed out)
beside its warm-up (generate) or first-call (prefill) wall time, and the summary prints both.

The target pair (batch 32 compiled) runs first. Every measurement runs in its own try/except under its
own time limit (SIGALRM): a failure or a timeout is recorded and the rest still run, until --time-limit
is spent (later rows are then recorded as skipped). The run's JSON (``--work``, default a temporary folder:
hf_patch_<part>.json) is rewritten after every row, so a run killed from outside keeps what it measured; at
the end one keyed row per measurement (benchmarks/rows.py: commit, date, GPU, versions; ``table`` and
``row`` name it) is appended to results/<gpu-slug>/hf_patch.json, the ratios and verdicts as its top-level
fields.
genprof (``--part genprof``, ``bench_genprof``): one generate per variant (compiled rows only) split into
its eager prefill, its compiled calls (host time, device span by CUDA events, count against the decode
steps) and generate's own loop (cProfile with profiling off in the other two: top 40 functions by tottime
and by cumtime a step, and a diff tritune vs hf), with the syncs of each phase (torch.cuda sync debug
mode), CUDA-graph trees' records / warm-ups / replays / invariant checks, the StaticCache's addresses
per generate (static graph inputs: a new address is a re-recording) and dynamo's counters. On the CPU
(--smoke --smoke-backend inductor --stub-kernels --batches 32 --smoke-layers 12 --new 48, 2026-11-24):
the loop makes the same Python calls a step in both (858), one compiled call a step, no recompile.
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
floor (``--part floor``): HF ``generate`` (the same batch, prompt, new tokens, static cache, greedy) driving
a GPT2LMHeadModel whose forward costs ~nothing (``_floor_model``: one gather from a logits table, the cache
allocated and advanced as HF's layers do, the same output type), eager and compiled (the same recipe),
then patched+compile and HF+compile. floor and generate time their rows in interleaved rounds (``interleaved``
in main: all warmed first, then --rounds rounds in alternating order, median), so the process's drift
(the host calibration doubled through one H100 run) falls on every row alike. Its ms a step is generate's own loop on the host: the best any model can do under this
generate; ``hf+compile / floor`` above 1.3 is the room the target needs. Every generate and genprof row
also records a fixed host calibration (a Python loop, 200 tiny device ops) measured in that row, Python's
GC collections and tracked objects, and who used the CPU during the timed generates (cores of this
process and of others, busy threads, involuntary context switches): the same Python running slower in
one row than in another is then either the process (calibration up), the GC, contention, or the row.
Found (2026-11-24, CPU, --smoke --smoke-backend inductor --stub-kernels, 12 layers, b=32, 48 new): no GC
collection at all during a generate (HF and patched: tensors die by refcount), ~0 objects surviving a
generate either way; loop a step 685 us patched vs 688 HF; the floor's loop 0.51 (eager) / 0.65 ms
(compiled) a step on this CPU.
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
import sys
import tempfile
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
    """The commit measured ($TRITUNE_COMMIT where set: a copied tree's .git may be stale)."""
    from rows import commit

    return commit()


def _ok_rows(rows: dict, width: int):
    """The rows of a table that ran; a failed row prints its error instead."""
    for k, v in rows.items():
        if "error" in v:
            print(f"  {k:{width}s} {v['error'][:100]}")
            continue
        yield k, v


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


# --- --part floor: generate's own loop, driving a model that costs ~nothing ---------------------------
FLOOR_ROWS = 8  # the logits table's rows: the next token is a function of the last one, cycling over 8


def _floor_cache(model, cache, ids, kwargs) -> None:
    """What the loop can see of a cache, kept as HF's layers keep it, at ~no cost: the prefill allocates
    the static tensors through ``cache.update`` (lazy initialization, static addresses marked) like the
    real model; a decode step advances the layers' write counters (``cumulative_length``, what
    ``get_seq_length`` reads) in one foreach kernel. The keys and values written are nothing the loop
    reads. Older transformers (no counter: positions from the loop's cache_position) advance nothing."""
    cache = getattr(cache, "self_attention_cache", cache)
    layers = getattr(cache, "layers", None)
    if not layers:
        return
    B, T = ids.shape
    if not all(getattr(lay, "is_initialized", True) for lay in layers):
        cfg = model.config
        kv = torch.zeros(B, cfg.n_head, T, cfg.n_embd // cfg.n_head, dtype=model.dtype, device=ids.device)
        extra = ({"cache_position": kwargs["cache_position"]},) if kwargs.get("cache_position") is not None else ()
        for i in range(len(layers)):
            cache.update(kv, kv, i, *extra)
        return
    lens = [lay.cumulative_length for lay in layers if isinstance(getattr(lay, "cumulative_length", None), torch.Tensor)]
    if lens:
        torch._foreach_add_(lens, T)


def _floor_model(base):
    """A GPT2LMHeadModel (same class tree, config, generation config, cache handling and output type, so
    generate's loop runs the same Python) whose forward reads one row of a preallocated logits table:
    logits = table[last token % 8], one gather on the device. Row j's argmax is a token = j + 1 (mod 8),
    so the tokens cycle and never hit EOS. Its ms a step is the host cost of generate's own loop: the
    best any model driven by this generate can do."""
    import inspect

    from transformers import GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    class FloorGPT2(GPT2LMHeadModel):
        def forward(self, input_ids=None, *args, **kwargs):
            name = "cache" if "cache" in kwargs else "past_key_values"  # transformers >= 5.2x: cache
            cache = kwargs.get(name)
            if cache is not None:
                _floor_cache(self, cache, input_ids, kwargs)
            logits = self.floor_logits[input_ids[:, -1] % FLOOR_ROWS].unsqueeze(1)  # (B, 1, V)
            return CausalLMOutputWithCrossAttentions(logits=logits, **({name: cache} if cache is not None else {}))

    # generate reads the forward's parameters (logits_to_keep, ...): the real model's
    FloorGPT2.forward.__signature__ = inspect.signature(GPT2LMHeadModel.forward)
    torch.manual_seed(0)
    m = FloorGPT2(copy.deepcopy(base.config)).to(base.device, base.dtype).eval()
    m.generation_config = copy.deepcopy(base.generation_config)
    V = base.config.vocab_size
    first = FLOOR_ROWS * ((V // 2) // FLOOR_ROWS)  # a token = 0 (mod 8) in the middle of the vocabulary
    table = torch.randn(FLOOR_ROWS, V, generator=torch.Generator().manual_seed(5)).clamp_(-3, 3)
    table[torch.arange(FLOOR_ROWS), first + (torch.arange(FLOOR_ROWS) + 1) % FLOOR_ROWS] = 10.0
    m.register_buffer("floor_logits", table.to(base.device, base.dtype), persistent=False)
    return m


def _variant(base, patched: bool, compiled: bool, floor: bool = False):
    """A copy of ``base``, patched or not (or the floor model); ``compiled``: generate compiles its decode
    steps (transformers' CompileConfig, see the module docstring)."""
    from tritune.model import patch as hf_patch

    m = _floor_model(base) if floor else copy.deepcopy(base)
    if patched:  # tritune.patch's default: the compiled rows replay its thin CUDA graphs
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


@contextlib.contextmanager
def _gc_watch(out: dict):
    """Python's garbage collections while inside, into ``out``: {"gen<g>": [collections, seconds]}. A
    full (gen 2) collection walks every tracked object of the process (after a few compiles, millions):
    tens of ms in one step, which a mean a step spreads over all."""
    import gc

    began = {}

    def cb(phase, info):
        g = info.get("generation")
        if phase == "start":
            began[g] = time.perf_counter()
            return
        n_s = out.setdefault(f"gen{g}", [0, 0.0])
        n_s[0] += 1
        n_s[1] += time.perf_counter() - began.pop(g, time.perf_counter())

    gc.callbacks.append(cb)
    try:
        yield out
    finally:
        gc.callbacks.remove(cb)


def _cpu_now() -> dict:
    """Linux counters: the machine's busy jiffies (/proc/stat), this process's CPU time by thread and its
    involuntary context switches (preempted while runnable: another thread or process took its core)."""
    out = {"t": time.perf_counter()}
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        out["busy"] = sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # all but idle and iowait
        with open("/proc/self/status") as f:
            out["invol"] = next(int(ln.split()[1]) for ln in f if ln.startswith("nonvoluntary_ctxt_switches"))
        threads = {}
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    st = f.read()
                name, rest = st[st.index("(") + 1:st.rindex(")")], st[st.rindex(")") + 2:].split()
                name = "main" if tid == str(os.getpid()) else name
                threads[tid] = (name, int(rest[11]) + int(rest[12]))  # utime + stime
        out["threads"] = threads
    except (OSError, ValueError, StopIteration):  # not Linux: nothing but the wall time
        pass
    return out


@contextlib.contextmanager
def _cpu_watch(out: dict):
    """Who used the CPU while inside, into ``out``: cores busy on the machine, in this process, and in
    other processes (compile workers, other tenants); this process's busy threads; its involuntary
    context switches. The same Python running slower with other_cores > 0 or many switches is contention."""
    a = _cpu_now()
    try:
        yield out
    finally:
        b = _cpu_now()
        wall, hz = b["t"] - a["t"], os.sysconf("SC_CLK_TCK")
        if "busy" in a and "busy" in b and wall > 0:
            own = {tid: (nm, c - a["threads"].get(tid, (nm, 0))[1]) for tid, (nm, c) in b["threads"].items()}
            own_cores = sum(c for _, c in own.values()) / hz / wall
            busy_cores = (b["busy"] - a["busy"]) / hz / wall
            out.update(wall_s=round(wall, 3), machine_cores=round(busy_cores, 2), own_cores=round(own_cores, 2),
                       other_cores=round(busy_cores - own_cores, 2), involuntary_switches=b["invol"] - a["invol"],
                       busy_threads=sorted(f"{nm}:{c / hz / wall:.2f}" for nm, c in own.values() if c / hz / wall > 0.05))


def _gc_objects() -> int:
    import gc

    return len(gc.get_objects())


def _host_calibration() -> dict:
    """The same fixed host work in every row: a pure-Python loop, and 200 tiny in-place ops on the device
    (host time, synced after): where it grows from row to row, the process (or the machine) got slower,
    not the row's model."""
    x = torch.zeros(8, device=_dev())

    def python():
        d: dict = {}
        for i in range(20000):
            d[i & 63] = d.get(i & 63, 0) + i

    def ops():
        for _ in range(200):
            x.add_(1)

    out = {}
    for name, fn in (("python_us", python), ("torch_ops_us", ops)):
        fn()
        ts = []
        for _ in range(5):
            _sync()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        _sync()
        out[name] = round(statistics.median(ts) * 1e6, 1)
    return out


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
    calib, gcs, cpu, times = _host_calibration(), {}, {}, []
    with _gc_watch(gcs), _cpu_watch(cpu):
        for _ in range(reps):
            _sync()
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            _sync()
            times.append(time.perf_counter() - t0)
    made = out.shape[1] - prompt
    s = statistics.median(times)
    return {"batch": batch, "prompt": prompt, "new_tokens": made, "s": s, "tok_s": batch * made / s,
            "ms_per_step": s / made * 1e3, "runs_s": times, "warmup_s": warm_s, "host_calibration": calib,
            "gc": gcs, "gc_objects": _gc_objects(), "cpu": cpu,
            "compiled_call": hasattr(model, "_compiled_call"), "compile_s": _compile_s(),
            "cudagraph_skips": torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0) - skips0,
            **({"profile": profile_generate(model, ids, kw, made)} if PROFILE["on"] else {})}


PROFILE = {"on": False, "top": 12}
PARTS = ("floor", "generate", "step", "genprof", "prefill", "all")


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
    # contiguous (B, H, T, D) as the launcher's: empty_like would keep q's transposed strides, which a compiled
    # graph's output check refuses against the op's fake
    attention.attention = lambda q, *a, **k: torch.empty(q.shape, dtype=q.dtype, device=q.device)


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


# --- --part genprof: one whole generate, function by function, outside the compiled call -------------
def _fn_label(key) -> str:
    file, line, name = key
    if file == "~":
        return name  # a builtin: "{method 'item' of 'torch._C.TensorBase' objects}"
    parts = file.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}({name})"


def _pstats_rows(stats, steps: int) -> dict:
    """{function: [calls a step, tottime us a step, cumtime us a step]} from a pstats.Stats."""
    return {_fn_label(k): [nc / steps, tt / steps * 1e6, ct / steps * 1e6]
            for k, (cc, nc, tt, ct, _) in stats.stats.items()}


def _top(rows: dict, col: int, n: int = 40) -> list:
    return [[k, round(v[0], 2), round(v[1], 1), round(v[2], 1)]
            for k, v in sorted(rows.items(), key=lambda kv: -kv[1][col])[:n]]


def _counters() -> dict:
    return {cat: dict(c) for cat, c in torch._dynamo.utils.counters.items()}


def _counter_diff(before: dict, after: dict) -> dict:
    out = {}
    for cat, c in after.items():
        d = {k: v - before.get(cat, {}).get(k, 0) for k, v in c.items()}
        d = {k: v for k, v in d.items() if v}
        if d:
            out[cat] = d
    return out


_TREE_METHODS = ("record_function", "run_eager", "execute_node", "try_end_curr_execution",
                 "apply_checkpoint_execution_state_in_allocator")


@contextlib.contextmanager
def _count_tree_calls(counts: dict):
    """Counts calls of CUDA-graph trees' manager methods (record a graph, warm up eagerly, replay one, end a
    path, checkpoint the allocator) and of a node's invariant check (one a recorded graph tried per call):
    a step should be one replay and a few checks. Nothing where inductor or the methods are missing."""
    try:
        from torch._inductor import cudagraph_trees as ct
    except Exception:  # pragma: no cover
        yield
        return
    saved = []
    for cls, names in ((ct.CUDAGraphTreeManager, _TREE_METHODS), (ct.CUDAGraphNode, ("check_invariants",))):
        for name in names:
            fn = getattr(cls, name, None)
            if fn is None:
                continue

            def counted(*a, _fn=fn, _name=name, **k):
                counts[_name] = counts.get(_name, 0) + 1
                return _fn(*a, **k)

            saved.append((cls, name, fn))
            setattr(cls, name, counted)
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def _cache_ptrs(kwargs) -> tuple:
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    cache = getattr(cache, "self_attention_cache", cache)
    return tuple(t.data_ptr() for lay in getattr(cache, "layers", ())
                 for t in (getattr(lay, "keys", None), getattr(lay, "values", None),
                           getattr(lay, "cumulative_length", None))  # all three marked static addresses
                 if isinstance(t, torch.Tensor))


def _unpatched(fn, model):
    """``fn`` run with ``model``'s patched modules on their original forwards (the patched ones put back
    after, the same objects, so that the compiled decode's guards still hold)."""
    mods = [m for m in model.modules() if hasattr(m, "_tritune_original_forward")]

    def run(*a, **k):
        saved = [m.forward for m in mods]
        for m in mods:
            m.forward = m._tritune_original_forward
        try:
            return fn(*a, **k)
        finally:
            for m, f in zip(mods, saved):
                m.forward = f
    return run


@torch.no_grad()
def bench_genprof(model, batch: int, prompt: int, new: int) -> dict:
    """After a warm-up generate (compiles, records the graph), two generates:
    - timed: wall time; the prefill's (eager, synced before and after); the compiled calls' count and host
      time (no sync); on CUDA each call's device span (events around it) and each step's (event to event,
      call to call); CUDA-graph trees' records, warm-ups, replays, invariant checks; dynamo's counters;
      the StaticCache's tensors' addresses (static inputs of the graph: a new address is a re-recording);
    - profiled: cProfile of the loop OUTSIDE the prefill and the compiled calls (profiling off inside them),
      generate's own host work a step: the top 40 functions by tottime and by cumtime; and the syncs of
      each phase (torch.cuda sync debug mode: a warning per synchronizing call)
    - on a patched model, timed once more with HF's own prefill (``hf_prefill``).
    loop_us = (wall - prefill - compiled calls' host time) / decode steps: generate's own loop, the wait
    for the device included (it syncs on each step's stop check)."""
    import cProfile
    import pstats
    import warnings

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, VOCAB, (batch, prompt), generator=g).to(_dev())
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    cuda = torch.cuda.is_available() and not SMOKE["on"]
    compiled, prefill_of = None, model._prefill
    prof = cProfile.Profile()
    st: dict = {}

    def reset(profiling: bool):
        st.update(calls=0, call_s=0.0, call_list=[], prefill_s=0.0, ptrs=[], events=[], profiling=profiling,
                  syncs={"prefill": 0, "call": 0}, caught=None, own=0)

    def n_warned():
        return 0 if st["caught"] is None else sum("synchroniz" in str(w.message).lower() for w in st["caught"])

    def prefill(*a, **k):  # eager; synced so that its device time is its own
        if st["profiling"]:
            prof.disable()
        w0 = n_warned()
        _sync()
        t0 = time.perf_counter()
        try:
            return prefill_of(*a, **k)
        finally:
            _sync()
            st["prefill_s"] += time.perf_counter() - t0
            st["syncs"]["prefill"] += n_warned() - w0 - 2 * st["own"]  # less our own two syncs
            if st["profiling"]:
                prof.enable()

    def call(*a, **k):  # no sync: the host's share of the compiled call, as generate pays it
        if st["profiling"]:
            prof.disable()
        w0 = n_warned()
        st["ptrs"].append(_cache_ptrs(k))
        if cuda and not st["profiling"]:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        try:
            return compiled(*a, **k)
        finally:
            st["call_list"].append(time.perf_counter() - t0)
            st["call_s"] += st["call_list"][-1]
            st["calls"] += 1
            if cuda and not st["profiling"]:
                e1.record()
                st["events"].append((e0, e1))
            st["syncs"]["call"] += n_warned() - w0
            if st["profiling"]:
                prof.enable()

    cc = model.generation_config.compile_config
    if cc is not None and not model.generation_config.disable_compile:
        compiled = model.get_compiled_call(cc)  # made now (generate takes it) so that it can be wrapped
        model._compiled_call = call
    model._prefill = prefill
    try:
        reset(False)
        warm0, warm_tree = _counters(), {}
        with _count_tree_calls(warm_tree):
            model.generate(ids, **kw)  # warm-up: compiles, records the graph, fills the tuned-config caches
            _sync()
            warm_ptrs = [set(st["ptrs"])]  # the addresses the graph was recorded with
            reset(False)
            model.generate(ids, **kw)
            warm_ptrs.append(set(st["ptrs"]))
        warm_counts = _counter_diff(warm0, _counters())
        reset(False)
        counts0, tree, gcs, cpu = _counters(), {}, {}, {}
        calib = _host_calibration()
        with _count_tree_calls(tree), _gc_watch(gcs), _cpu_watch(cpu):
            _sync()
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            _sync()
            wall = time.perf_counter() - t0
        counts = _counter_diff(counts0, _counters())
        timed = dict(st)
        steps = out.shape[1] - prompt
        decode = max(1, steps - 1)
        call_dev = [a.elapsed_time(b) * 1e3 for a, b in timed["events"]]  # us
        step_dev = [a[0].elapsed_time(b[0]) * 1e3 for a, b in zip(timed["events"], timed["events"][1:])]
        # profiled (its wall time not reported): cProfile outside the prefill and the calls, and the syncs
        reset(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            st["caught"] = caught
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
                _sync()
                st["own"] = n_warned()  # the warnings one torch.cuda.synchronize() gives (0 or 1)
            try:
                prof.enable()
                model.generate(ids, **kw)
                prof.disable()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
            syncs_all = n_warned() - 3 * st["own"]  # less the probe above and the prefill's two
            kinds = sorted({str(w.message).splitlines()[0][:120] for w in caught
                            if "synchroniz" in str(w.message).lower()})
        profiled = dict(st)
        _sync()
        hybrid = None
        if getattr(model, "_tritune_patched", False):
            # the patched decode after HF's own prefill: if this recovers HF's time a step, the prefill was it
            prefill_of = _unpatched(prefill_of, model)
            reset(False)
            model.generate(ids, **kw)  # settles the allocator (a re-recording, if any, falls here)
            reset(False)
            tree_h = {}
            with _count_tree_calls(tree_h):
                _sync()
                t0 = time.perf_counter()
                model.generate(ids, **kw)
                _sync()
                wall_h = time.perf_counter() - t0
            hybrid = {"wall_ms_per_step": wall_h / steps * 1e3, "prefill_ms": st["prefill_s"] * 1e3,
                      "call_host_us": st["call_s"] / max(1, st["calls"]) * 1e6, "cudagraph_trees": tree_h,
                      "loop_us": (wall_h - st["prefill_s"] - st["call_s"]) / decode * 1e6}
    finally:
        del model._prefill
        if compiled is not None:
            model._compiled_call = compiled
    rows = _pstats_rows(pstats.Stats(prof), decode)
    med = statistics.median
    return {"batch": batch, "prompt": prompt, "new_tokens": steps, "decode_steps": steps - 1,
            "compiled_calls": timed["calls"], "wall_ms_per_step": wall / steps * 1e3,
            "prefill_ms": timed["prefill_s"] * 1e3, "call_host_us": timed["call_s"] / max(1, timed["calls"]) * 1e6,
            "loop_us": (wall - timed["prefill_s"] - timed["call_s"]) / decode * 1e6,
            "call_host_us_median": med(timed["call_list"]) * 1e6 if timed["call_list"] else None,
            "call_host_us_max": max(timed["call_list"]) * 1e6 if timed["call_list"] else None,
            "gc": gcs, "gc_objects": _gc_objects(), "host_calibration": calib, "cpu": cpu,
            "call_device_us": med(call_dev) if call_dev else None,
            "call_device_us_max": max(call_dev) if call_dev else None,
            "step_device_us": med(step_dev) if step_dev else None,
            "syncs": ({"all": syncs_all, **profiled["syncs"],
                       "loop": syncs_all - profiled["syncs"]["prefill"] - profiled["syncs"]["call"]} if cuda else None),
            "sync_kinds": kinds, "cudagraph_trees": tree,
            # the StaticCache's tensors (static graph inputs) in the warm-up, the second and the timed generate
            "cache_addresses_per_generate": [len(p) for p in (*warm_ptrs, set(timed["ptrs"]))],
            "cache_addresses_seen": len(set(timed["ptrs"]).union(*warm_ptrs)),
            "loop_python_calls_per_step": sum(v[0] for v in rows.values()), "dynamo_counters": counts,
            "warmup_dynamo_counters": warm_counts, "warmup_cudagraph_trees": warm_tree, "hf_prefill": hybrid,
            "top_tottime": _top(rows, 1), "top_cumtime": _top(rows, 2), "_rows": rows}


def genprof_diff(a: dict, b: dict, n: int = 40) -> list:
    """Per function: (calls a step, tottime us a step) in b and in a, the n largest tottime differences,
    then every function whose calls a step differ (what one variant's loop does that the other's does not)."""
    ra, rb = a.get("_rows", {}), b.get("_rows", {})
    keys = set(ra) | set(rb)
    z = [0.0, 0.0, 0.0]
    rows = [[k, round(rb.get(k, z)[0], 2), round(ra.get(k, z)[0], 2), round(rb.get(k, z)[1] - ra.get(k, z)[1], 1)]
            for k in keys]
    by_time = sorted(rows, key=lambda r: -abs(r[3]))[:n]
    by_calls = sorted((r for r in rows if abs(r[1] - r[2]) > 0.01 and r not in by_time), key=lambda r: -abs(r[1] - r[2]))
    return by_time + by_calls[:n]


@torch.no_grad()
def bench_prefill(fn, ids, reps: int) -> dict:
    t0 = time.perf_counter()
    fn(ids)  # a compiled fn compiles here
    _sync()
    first_s = time.perf_counter() - t0
    for _ in range(0 if SMOKE["on"] else 2):
        fn(ids)
    ms, host = [], []
    for _ in range(reps):
        if SMOKE["on"]:  # no CUDA events on the CPU
            t0 = time.perf_counter()
            fn(ids)
            ms.append((time.perf_counter() - t0) * 1e3)
            host.append(ms[-1])
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn(ids)
        host.append((time.perf_counter() - t0) * 1e3)  # the call returned: every launch queued, none waited for
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    # host_ms close to ms: the forward is host-bound (the device waits for launches); far below: device-bound
    return {"ms": statistics.median(ms), "runs_ms": ms, "host_ms": statistics.median(host), "host_runs_ms": host,
            "tok_s": ids.numel() / statistics.median(ms) * 1e3, "first_s": first_s, "compile_s": _compile_s()}


@contextlib.contextmanager
def direct_kernels():
    """The non-mutating ops a prefill calls (linear, layer_norm, attention) with their bodies registered
    straight at the device's backend and autograd keys for the duration (a Library removed on exit):
    ``torch.ops.tritune.<op>`` then costs the C++ dispatcher and the body, without custom_op's Python
    layers (autograd_impl, redispatch, backend_impl, the dynamo-disable wrapper). A measurement of what
    a leaner registration in kernels/torch_ops.py would save, not a fix: the autograd-key kernel here
    makes outputs that carry no grad_fn, so it is only sound with autograd off (the prefill rows); and
    tracing would hand it fake tensors: compile before entering."""
    from tritune.kernels import torch_ops

    dev = "CPU" if SMOKE["on"] else "CUDA"
    lib = torch.library.Library("tritune", "IMPL")
    try:
        for name in ("linear", "layer_norm", "attention"):
            for key in (dev, "Autograd" + dev):
                lib.impl(name, torch_ops.EAGER[name], key)
        yield
    finally:
        lib._destroy()


def bench_dispatch(n: int) -> dict:
    """Host us a call of one tritune op, three ways: the op's body as eager patched layers call it
    (``torch_ops.EAGER``), ``torch.ops.tritune`` under no_grad (what a compiled graph's inductor wrapper
    calls: custom_op's autograd and backend layers in Python), and the same under inference_mode (no
    autograd layer). A (16, 768) x (768, 768) linear (gemm past gemv's 8 rows): a few us on the device,
    so n back-to-back calls are host-bound and their wall time a call is the host's cost."""
    from tritune.kernels import torch_ops

    g = torch.Generator().manual_seed(6)
    dt = torch.float32 if SMOKE["on"] else torch.bfloat16
    x, w, bias = (torch.randn(*s, generator=g).to(_dev(), dt) for s in ((16, 768), (768, 768), (768,)))
    ways = {"eager_body_us": (torch.no_grad, torch_ops.EAGER["linear"]),
            "op_no_grad_us": (torch.no_grad, torch.ops.tritune.linear.default),
            "op_inference_mode_us": (torch.inference_mode, torch.ops.tritune.linear.default),
            "op_direct_us": (torch.no_grad, torch.ops.tritune.linear.default)}
    out = {}
    for name, (mode, fn) in ways.items():
        with mode(), (direct_kernels() if name == "op_direct_us" else contextlib.nullcontext()):
            for _ in range(3):
                fn(x, w, bias, None, x)
            _sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x, w, bias, None, x)
            _sync()
            out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def _cpu_cols(c: dict) -> str:
    if "own_cores" not in c:
        return "-"
    return f"{c['own_cores']:5.2f}/{c['other_cores']:<5.2f}  {c['involuntary_switches']:8d}  {' '.join(c['busy_threads'])[:60]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results", help="results root (default: results)")
    ap.add_argument("--work", default=None, help="folder for the run's JSON as it goes (default: a temporary one)")
    ap.add_argument("--part", default="all", help="comma-separated: " + ", ".join(PARTS)
                    + " (all: generate, step, prefill)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 32 1 (--part genprof: 32)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="step, prefill: timed reps")
    ap.add_argument("--rounds", type=int, default=5, help="floor, generate: interleaved rounds (median)")
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
    parts = set(args.part.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--part: {args.part!r}: expected a comma-separated list of {', '.join(PARTS)}")
    if "all" in parts:
        parts |= {"generate", "step", "prefill"}
    one_batch = parts <= {"genprof", "floor"}  # parts that default to batch 32 alone
    PROFILE["on"] = args.profile
    if args.batches is None:
        args.batches = [32] if one_batch else [32, 1]
    if args.smoke:
        global VOCAB
        SMOKE["on"], VOCAB, SMOKE["backend"] = True, SMOKE["config"]["vocab_size"], args.smoke_backend
        SMOKE["config"]["n_layer"] = args.smoke_layers
        # --part step keeps up to 48 new tokens (its loop_us: HF's loop a step, not the prefill's share)
        # --part genprof too, and keeps --batches when given (a batch of 32 costs the tiny model little)
        new = min(args.new, 48) if parts & {"step", "genprof", "floor"} else 3
        batches = args.batches[:1] if one_batch and args.batches else [2]
        args.batches, args.prompt, args.new, args.reps, args.prefill = batches, 5, new, 1, [2, 16]
        args.rounds = min(args.rounds, 2)
        if args.stub_kernels:
            stub_kernels()
    elif not torch.cuda.is_available():
        print("bench_hf_patch: needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.time_limit
    args.work = args.work or tempfile.mkdtemp(prefix="hf_patch_")
    os.makedirs(args.work, exist_ok=True)
    import transformers
    import triton

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    res = {"date": datetime.date.today().isoformat(), "commit": _commit(),
           "device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "model": "GPT-2 small config, random init, bf16", "args": vars(args), "generate": {}, "prefill": {},
           "step": {}, "genprof": {}, "checks": {}}
    res["floor"] = {}
    name = "-".join(p for p in PARTS if p in parts)
    path = os.path.join(args.work, f"hf_patch_{name}.json")

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
    def interleaved(table, specs, b):
        """The rows of one batch timed in interleaved rounds: all compiled and warmed first (no dynamo reset
        between them), then each round times one generate of every row, in alternating order (A B, B A,
        ...), each after an untimed generate (what switching models may have evicted is re-made there) and
        a host calibration; a row's ms a step is its median over the rounds. The process's drift (the host
        calibration grew 2x through one H100 run) then falls on every row alike."""
        ids = torch.randint(1, VOCAB, (b, args.prompt), generator=torch.Generator().manual_seed(b)).to(_dev())
        kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, cache_implementation="static")
        torch._dynamo.reset()
        models = {}
        for key, make in specs:
            left = deadline - time.monotonic()
            if left < 15:
                res[table][key] = {"error": "skipped: --time-limit spent"}
                continue
            c0 = _compile_s()
            try:
                with _limit(min(args.variant_limit, left)), torch.no_grad():
                    m = make()
                    t0 = time.perf_counter()
                    m.generate(ids, **kw)
                    _sync()
                    res[table][key] = {"warmup_s": time.perf_counter() - t0, "runs_s": [], "calibs": [], "cpus": [],
                                       "gc": {}, "compiled_call": hasattr(m, "_compiled_call")}
                    models[key] = m
            except Exception as e:
                res[table][key] = _error(e)
            res[table][key]["compile_s"] = round(_compile_s() - c0, 2)
            save()
            print(table, key, "warm-up", {k: res[table][key].get(k) for k in ("warmup_s", "compile_s", "error")},
                  flush=True)
        keys = list(models)
        for r in range(args.rounds):
            if deadline - time.monotonic() < 10:
                break
            for key in (keys if r % 2 == 0 else keys[::-1]):
                m, v = models[key], res[table][key]
                try:
                    with _limit(max(5.0, deadline - time.monotonic())), torch.no_grad():
                        m.generate(ids, **kw)
                        v["calibs"].append(_host_calibration())
                        cpu = {}
                        with _gc_watch(v["gc"]), _cpu_watch(cpu):
                            _sync()
                            t0 = time.perf_counter()
                            out = m.generate(ids, **kw)
                            _sync()
                            v["runs_s"].append(time.perf_counter() - t0)
                        v["cpus"].append(cpu)
                        v["new_tokens"] = out.shape[1] - args.prompt
                except Exception as e:
                    v.update(_error(e))
                    models.pop(key)
                    keys.remove(key)
        for key in (k for k, _ in specs):
            v = res[table][key]
            if "error" in v and not v.get("runs_s"):
                continue
            if not v.get("runs_s"):
                v.setdefault("error", "no timed round")
                continue
            s = statistics.median(v["runs_s"])
            mid = min(range(len(v["runs_s"])), key=lambda i: abs(v["runs_s"][i] - s))
            v.update(batch=b, prompt=args.prompt, s=s, tok_s=b * v["new_tokens"] / s,
                     ms_per_step=s / v["new_tokens"] * 1e3, rounds=len(v["runs_s"]), cpu=v["cpus"][mid],
                     host_calibration={f: statistics.median(c[f] for c in v["calibs"]) for f in v["calibs"][0]},
                     gc_objects=_gc_objects())
            call = getattr(models.get(key), "_compiled_call", None)
            if isinstance(getattr(call, "stats", None), dict):  # tritune's ThinGraphCall: captures, replays, fallbacks
                v["graphs"] = dict(call.stats)
        save()

    base = _model()
    if "floor" in parts:
        for b in args.batches:
            interleaved("floor", [(f"{key} b={b}", lambda p=p, c=c, f=f: _variant(base, p, c, f))
                                  for key, p, c, f in (("floor+compile", False, True, True),
                                                       ("floor", False, False, True),
                                                       ("tritune+compile", True, True, False),
                                                       ("hf+compile", False, True, False))], b)
    if "generate" in parts:
        for b in args.batches:
            rows = [(n, p, c) for c in ((True,) if args.compiled_only else (True, False))
                    for n, p in (("hf", False), ("tritune", True))]
            interleaved("generate", [(f"{n}{'+compile' if c else ''} b={b}",
                                      lambda p=p, c=c: _variant(base, p, c)) for n, p, c in rows], b)

    if "step" in parts:
        for b in args.batches:
            for name, patched in (("hf", False), ("tritune", True)):
                row("step", f"{name}+compile b={b}",
                    lambda: bench_step(_variant(base, patched, True), b, args.prompt, args.new, args.reps))

    if "genprof" in parts:  # not in "all": its cProfile'd generate is not a measurement of speed
        for b in args.batches:
            for name, patched in (("hf", False), ("tritune", True)):
                row("genprof", f"{name}+compile b={b}",
                    lambda: bench_genprof(_variant(base, patched, True), b, args.prompt, args.new))
            hf, ours = res["genprof"].get(f"hf+compile b={b}", {}), res["genprof"].get(f"tritune+compile b={b}", {})
            if "_rows" in hf and "_rows" in ours:
                res["genprof"][f"diff b={b}"] = {
                    "columns": ["function", "tritune calls/step", "hf calls/step", "tottime us/step tritune - hf"],
                    "rows": genprof_diff(hf, ours)}
            for v in (hf, ours):
                v.pop("_rows", None)
            save()

    if "prefill" in parts:
        def check():  # the patched model's logits against HF's (bf16 both, float64 HF as the reference)
            from tritune.kernels.runtime import compare as cmp

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

        def inference(f):  # the call (and so the compile) under inference_mode: the dispatcher skips autograd
            def run(x):
                with torch.inference_mode():
                    return f(x)
            return run

        prefill = (("tritune", lambda: fwd(_variant(base, True, False))),
                   ("tritune+compile", lambda: torch.compile(fwd(_variant(base, True, False)), fullgraph=True)),
                   ("tritune+compile inference_mode",
                    lambda: inference(torch.compile(fwd(_variant(base, True, False)), fullgraph=True))),
                   ("hf eager-attention", lambda: fwd(_model("eager"))),
                   ("hf sdpa", lambda: fwd(base)),
                   ("hf sdpa+compile", lambda: torch.compile(fwd(base), fullgraph=True)))
        if not args.smoke:  # CUDA graphs: no host work a replay, so ms is the kernels' own time (the device floor)
            ro = dict(fullgraph=True, mode="reduce-overhead")
            prefill += (("tritune+compile reduce-overhead", lambda: torch.compile(fwd(_variant(base, True, False)), **ro)),
                        ("hf sdpa+compile reduce-overhead", lambda: torch.compile(fwd(base), **ro)))
        reps = 1 if args.smoke else max(args.reps, 10)
        for name, make in prefill:
            row("prefill", name, lambda: bench_prefill(make(), ids, reps))

        def direct():  # the compiled patched prefill with the ops' dispatch cut to the C++ dispatcher + body
            fn = torch.compile(fwd(_variant(base, True, False)), fullgraph=True)
            with torch.no_grad():
                fn(ids)  # compiled outside: tracing runs the ops on fake tensors, which the bodies cannot take
            compile_s = _compile_s()
            with direct_kernels():
                return {**bench_prefill(fn, ids, reps), "compile_s": compile_s}

        row("prefill", "tritune+compile direct kernels", direct)
        # the compiled patched prefill calls 5 ops a layer + ln_f + head (test_compiled_prefill_launches_what_eager_
        # launches): their dispatch, which eager skips, is its extra host time
        n = 5 if args.smoke and not args.stub_kernels else 300
        row("prefill", "dispatch", lambda: {**bench_dispatch(n), "ops_per_forward": 5 * base.config.n_layer + 2})

    # ratios (the targets)
    g, p = res["generate"], res["prefill"]
    ratios = {}
    for b in args.batches:
        for a, c in (("tritune+compile", "hf+compile"), ("tritune", "hf")):
            x, y = g.get(f"{a} b={b}", {}), g.get(f"{c} b={b}", {})
            if "tok_s" in x and "tok_s" in y:
                ratios[f"{a} / {c} b={b}"] = x["tok_s"] / y["tok_s"]
    for a in ("tritune", "tritune+compile", "tritune+compile inference_mode", "tritune+compile direct kernels",
              "tritune+compile reduce-overhead"):
        for c in ("hf eager-attention", "hf sdpa", "hf sdpa+compile", "hf sdpa+compile reduce-overhead"):
            if "ms" in p.get(a, {}) and "ms" in p.get(c, {}):
                ratios[f"prefill {a} vs {c} (speedup)"] = p[c]["ms"] / p[a]["ms"]
    fl = res["floor"]
    for b in args.batches:
        floors = [fl.get(f"{k} b={b}", {}).get("ms_per_step") for k in ("floor+compile", "floor")]
        floors = [x for x in floors if x]
        hf = fl.get(f"hf+compile b={b}", {}).get("ms_per_step")
        if floors and hf:
            # HF+compile's step over the cheapest loop: the most any model under this generate can gain
            x = ratios[f"hf+compile / floor b={b}"] = hf / min(floors)
            res[f"floor_verdict b={b}"] = (
                f"1.3x reachable through the model (at most {x:.2f}x)" if x >= 1.3 else
                f"blocked by generate's own loop: at most {x:.2f}x over HF+compile with a model costing nothing")
    res["ratios"] = ratios
    x = ratios.get("tritune+compile / hf+compile b=32")
    res["target_batch32_1.3x"] = None if x is None else x >= 1.3
    save()
    if g:
        print("\ngenerate (static cache)        tok/s   ms/step  compile s  warm-up s")
        for k, v in g.items():
            print(f"  {k:28s} {v.get('tok_s', float('nan')):9.1f} {v.get('ms_per_step', float('nan')):8.3f} "
                  f"{v.get('compile_s', float('nan')):10.1f} {v.get('warmup_s', float('nan')):10.1f}  "
                  f"{v.get('error', '')[:90]}{json.dumps(v['graphs'])[:120] if 'graphs' in v else ''}")
    if fl:
        print("\nfloor: generate's loop, a model costing ~nothing   ms/step  runs ms/step        "
              "calib py/ops us  gc gen2 n/ms  gc objects  cores own/other  invol.sw  busy threads")
        for k, v in _ok_rows(fl, 28):
            runs = " ".join(f"{r / max(1, v['new_tokens']) * 1e3:.3f}" for r in v["runs_s"])
            c, g2 = v["host_calibration"], v["gc"].get("gen2", [0, 0.0])
            print(f"  {k:47s} {v['ms_per_step']:8.3f}  {runs:20s} {c['python_us']:7.0f}/{c['torch_ops_us']:<6.0f} "
                  f"{g2[0]:5d}/{g2[1] * 1e3:<7.1f} {v['gc_objects']:10d}  {_cpu_cols(v.get('cpu', {}))}")
            if "graphs" in v:
                print(f"  {'':47s} thin CUDA graphs: {json.dumps(v['graphs'])[:150]}")
        for b in args.batches:
            if f"floor_verdict b={b}" in res:
                print(f"  b={b}: {res[f'floor_verdict b={b}']}")
    if p:
        print(f"prefill {args.prefill[0]} x {args.prefill[1]}                         ms   host ms  compile s  first call s")
        for k, v in p.items():
            if k == "dispatch":
                continue
            print(f"  {k:38s} {v.get('ms', float('nan')):9.3f} {v.get('host_ms', float('nan')):9.3f} "
                  f"{v.get('compile_s', float('nan')):10.1f} {v.get('first_s', float('nan')):13.1f}  "
                  f"{v.get('error', '')[:90]}")
        d = p.get("dispatch", {})
        if "ops_per_forward" in d:
            n = d["ops_per_forward"]
            ways = ("op_no_grad_us", "op_inference_mode_us", "op_direct_us")
            extra = {k: n * (d[k] - d["eager_body_us"]) / 1e3 for k in ways}
            print(f"  dispatch: a linear call on the host {d['eager_body_us']:.1f} us as eager calls it; through "
                  f"torch.ops {d['op_no_grad_us']:.1f} (no_grad), {d['op_inference_mode_us']:.1f} (inference_mode), "
                  f"{d['op_direct_us']:.1f} (direct kernels); x {n} ops a forward = "
                  + " / ".join(f"+{extra[k]:.2f}" for k in ways) + " ms of host")
            e, c = p.get("tritune", {}), p.get("tritune+compile", {})
            if "ms" in e and "ms" in c:
                print(f"  measured: tritune+compile - tritune = {c['ms'] - e['ms']:+.2f} ms; host ms / ms: "
                      f"tritune {e['host_ms'] / e['ms']:.2f}, tritune+compile {c['host_ms'] / c['ms']:.2f} "
                      f"(near 1: host-bound)")
            r = p.get("tritune+compile reduce-overhead", {})
            if "ms" in r and "ms" in e:
                print(f"  device floor (CUDA graph replay, no host): {r['ms']:.2f} ms; eager's host share at least "
                      f"{e['ms'] - r['ms']:+.2f} ms, compiled's {c.get('ms', float('nan')) - r['ms']:+.2f} ms")
            res["prefill_dispatch_extra_ms"] = extra
            save()
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
        for k, v in _ok_rows(res["step"], 24):
            gr = v["graphs"][-1] if v["graphs"] else {}
            f = lambda x: "     -" if x is None else f"{x:6.0f}"  # noqa: E731
            print(f"  {k:24s} {f(v['host_us'])} {f(v['graph_call_us'])}  {f(v['outside_graph_us'])} {f(v['step_us'])} "
                  f"{f(v['device_us'])} |          {f(v['guard_us'])} {f(v['region_us'])} {f(v['graph_us'])} | "
                  f"{f(v['loop_us'])}  {gr.get('inputs')}({gr.get('static_inputs')})       {gr.get('outputs')}      "
                  f"{v['guard_lines']}")
    gp = {k: v for k, v in res["genprof"].items() if not k.startswith("diff")}
    if gp:
        print("genprof (one generate)      ms/step prefill ms call host us  loop us  py calls/step"
              "  calls/steps  dev call/step us  cache addrs  syncs pre/call/loop  graph trees  dynamo")
        for k, v in _ok_rows(gp, 24):
            dyn = {f"{c}.{n}": x for c, d in v["dynamo_counters"].items() for n, x in d.items()
                   if c in ("stats", "inductor", "recompiles", "graph_break", "frames") or "cudagraph" in n}
            sy = v["syncs"]
            sy = "-" if sy is None else f"{sy['prefill']}/{sy['call']}/{sy['loop']}"
            f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
            tree = {n[:12]: c for n, c in v["cudagraph_trees"].items()}
            print(f"  {k:24s} {v['wall_ms_per_step']:8.3f} {v['prefill_ms']:10.2f} {v['call_host_us']:11.0f} "
                  f"{v['loop_us']:8.0f} {v['loop_python_calls_per_step']:14.1f} {v['compiled_calls']:5d}/"
                  f"{v['decode_steps']:<5d} {f(v['call_device_us']):>7s}/{f(v['step_device_us']):<7s} "
                  f"{str(v['cache_addresses_per_generate']):>12s} {sy:>16s}  {json.dumps(tree)}  {json.dumps(dyn)[:200]}")
            c, g2, f1 = v["host_calibration"], v["gc"].get("gen2", [0, 0.0]), lambda x: "-" if x is None else f"{x:.0f}"
            print(f"  {'':24s} call host us median/max {f1(v['call_host_us_median'])}/{f1(v['call_host_us_max'])}  "
                  f"calib py/ops {c['python_us']:.0f}/{c['torch_ops_us']:.0f} us  gc gen2 {g2[0]}x {g2[1] * 1e3:.1f} ms  "
                  f"objects {v['gc_objects']}  cores own/other, invol.sw, threads {_cpu_cols(v['cpu'])}")
            h = v.get("hf_prefill")
            if h:
                print(f"  {'  same, HF prefill':24s} {h['wall_ms_per_step']:8.3f} {h['prefill_ms']:10.2f} "
                      f"{h['call_host_us']:11.0f} {h['loop_us']:8.0f}  {json.dumps(h['cudagraph_trees'])}")
        for k, v in res["genprof"].items():
            if k.startswith("diff"):
                print(f"genprof {k}: loop functions a step, tritune vs hf (largest tottime differences first)")
                for r in v["rows"][:15]:
                    print(f"    {r[3]:+8.1f} us  calls {r[1]:6.2f} vs {r[2]:6.2f}  {r[0][:90]}")
    for k, v in ratios.items():
        print(f"  {k:45s} {v:6.2f}x")
    if "target_batch32_1.3x" in res and res["target_batch32_1.3x"] is not None:
        print("target batch 32 >= 1.3x:", res["target_batch32_1.3x"])
    if res["checks"]:
        c = res["checks"].get("logits", {})
        print("checks", c.get("error", c))
    from rows import write_rows

    tables = ("generate", "prefill", "step", "genprof", "floor", "checks")
    rows = [{"table": t, "row": k, **(v if isinstance(v, dict) else {"value": v})}
            for t in tables for k, v in res[t].items()]
    out = write_rows("hf_patch", rows, args.results, **{k: v for k, v in res.items() if k not in tables},
                     command=" ".join(sys.argv))
    print("wrote", path, "and", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
