"""The in-process serving runs serve-bench times: the engine's configurations (``MODES``), the model
(a checkpoint of any family, or a real model's shape with random weights), a workload served with arrivals honoured
(:func:`run_engine`), the batch-1 decode rate, and a log of Triton compiles met inside a timed run."""
from __future__ import annotations

import sys
import time

from tritune.model.bench.workload import percentiles

# The defaults on a GPU and without one (serve-bench's docstring); a flag given explicitly always wins.
GPU_DEFAULTS = {"modes": "triton-graphs", "prompt_len": (64, 512), "output_len": (64, 512), "decode_tokens": 512,
                "naive_requests": 2, "naive_tokens": 64, "runs": 3}
# GPT-2 small in fp32 on a few CPU cores: a forward of 64 tokens takes 0.1 s to seconds, and the naive
# baseline re-runs the whole sequence per token (the old defaults: over 300 s before any output)
CPU_DEFAULTS = {"modes": "torch", "prompt_len": (16, 64), "output_len": (16, 64), "decode_tokens": 32,
                "naive_requests": 1, "naive_tokens": 8, "runs": 1}

MODES = {
    "torch": dict(backend="torch", cuda_graphs=False),
    "torch-compile": dict(backend="torch", cuda_graphs=False, compile=True),
    "triton": dict(backend="triton", cuda_graphs=False),
    "triton-graphs": dict(backend="triton", cuda_graphs=True),
    "triton-int8": dict(backend="triton", cuda_graphs=True, quant="int8"),
    "triton-int4": dict(backend="triton", cuda_graphs=True, quant="int4"),
    "triton-fp8": dict(backend="triton", cuda_graphs=True, quant="fp8"),
    "triton-fp8-kv": dict(backend="triton", cuda_graphs=True, quant="fp8", kv_cache_dtype="fp8"),
}


# Random-init stand-ins of real models' shapes (HF config fields), for serve-bench without a checkpoint;
# "gpt2" (GPT-2 small) is the default.
SHAPES = {
    "gpt2": dict(model_type="gpt2"),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def random_checkpoint(shape: str, folder, dtype=None):
    """A checkpoint of ``shape`` (:data:`SHAPES`) with transformers' random initialisation (seed 0), written
    into ``folder`` by ``save_pretrained``; the folder."""
    import torch
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")
    fields = dict(SHAPES[shape])
    kind = fields.pop("model_type")
    cfg = transformers.AutoConfig.for_model(kind, **fields)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):     # a GPU initialises 1B weights in seconds
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(folder), safe_serialization=True)
    del model
    return folder


def load_models(model_dir, dtype, device, need_hf=True, shape: str = "gpt2"):
    """(the model's config, its checkpoint directory, the transformers model or None): ``model_dir`` of any
    family :func:`tritune.model.load.load_model` runs, else a random checkpoint of ``shape`` written into a
    temporary directory (removed at exit). :func:`build_model` takes the config and directory."""
    import atexit
    import shutil
    import tempfile

    from tritune.model.gpt2 import weights as W

    if model_dir:
        directory = W.resolve(model_dir)
    else:
        directory = tempfile.mkdtemp(prefix=f"tritune-{shape}-")
        atexit.register(shutil.rmtree, directory, True)
        random_checkpoint(shape, directory, dtype)
    config = _family_config(directory)
    hf = None
    if need_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=dtype).to(device=device).eval()
    return config, directory, hf


def _family_config(directory):
    """The config object of the checkpoint's family (vocab_size, n_positions, ... as the engine reads them)."""
    from pathlib import Path

    from tritune.model.load import model_type

    f = Path(directory) / "config.json"
    if model_type(directory) == "gpt2":
        from tritune.model.gpt2.config import GPT2Config

        return GPT2Config.from_file(f)
    from tritune.model.llama.config import LlamaConfig

    return LlamaConfig.from_file(f)


def build_model(config, directory, backend, dtype, device):
    """The model of ``directory`` (:func:`load_models`'s second item) for ``backend``."""
    from tritune.model.load import load_model

    return load_model(directory, backend=backend, dtype=dtype, device=device)


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def progress(total, desc: str, unit: str = "tok", show: bool = False):
    """A tqdm bar (rate and ETA) on stderr, or a silent one: ``show`` False (``--quiet``, library calls)
    or stdout not a terminal (a log file, a pipe: no carriage-return litter)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not show or not sys.stdout.isatty())


class CompileLog:
    """Triton JIT compilations (kernel-cache misses: a compile, or a load from the on-disk cache) while
    active: a timed run that meets one is timing a compile, so runs report ``jit_compiles`` (and the
    first few kernels' names and constexprs) and a warm-up that misses a variant shows here."""

    def __init__(self):
        self.events = []
        self._saved = None

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        comp = kwargs.get("compile") if isinstance(kwargs.get("compile"), dict) else {}
        names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []

        def label(k):  # constants are keyed by (argument index,) paths
            i = k[0] if isinstance(k, tuple) and k and isinstance(k[0], int) else None
            return names[i] if i is not None and i < len(names) else str(k)

        self.events.append({"kernel": name.rsplit(".", 1)[-1], "num_warps": comp.get("num_warps"),
                            "constexprs": {label(k): v for k, v in (comp.get("constants") or {}).items()
                                           if isinstance(v, (int, float, bool, str))}})
        return False  # never skip the compile

    def __enter__(self):
        try:
            import triton

            knobs = triton.knobs.runtime
            self._saved = knobs.jit_cache_hook
            knobs.jit_cache_hook = self._hook
        except Exception:  # a Triton without the hook: nothing is logged
            self._saved = False
        return self

    def __exit__(self, *exc):
        if self._saved is not False:
            import triton

            triton.knobs.runtime.jit_cache_hook = self._saved

    def summary(self, limit: int = 12) -> dict:
        from collections import Counter

        return {"count": len(self.events), "by_kernel": dict(Counter(e["kernel"] for e in self.events)),
                "first": self.events[:limit]}


def run_engine_repeated(engine, items, runs: int, *, desc: str = "run", show_progress: bool = False) -> dict:
    """The workload ``runs`` times on the same warm engine, its prefix cache emptied before each (a repeat
    would find every prompt cached): the run of median output tok/s, with ``spread`` (each run's output
    tok/s, TTFT p50 and TPOT p50; their min and max). A serving run is seconds of host-bound work whose
    throughput moves by several percent from one run to the next (docs/findings.md)."""
    done = []
    for i in range(runs):
        engine.pool.reset_cache()
        done.append(run_engine(engine, items, desc=desc if runs == 1 else f"{desc} {i + 1}/{runs}",
                               show_progress=show_progress))
    order = sorted(range(runs), key=lambda i: done[i]["output_tok_s"])
    med = dict(done[order[(runs - 1) // 2]])
    if runs > 1:
        tok = [r["output_tok_s"] for r in done]
        med["spread"] = {"runs": runs, "output_tok_s": tok, "output_tok_s_min": min(tok), "output_tok_s_max": max(tok),
                         "ttft_p50_ms": [r["ttft_ms"]["p50"] for r in done],
                         "tpot_p50_ms": [r["tpot_ms"]["p50"] for r in done]}
    return med


def run_engine(engine, items, *, desc: str = "run", show_progress: bool = False) -> dict:
    """Serve ``items`` (arrivals relative to the start); metrics of the run (``jit_compiles``: the
    kernel variants first met inside the timed run; zero after a complete warm-up)."""
    with CompileLog() as log, progress(sum(it.output_len for it in items), desc, show=show_progress) as bar:
        r = run_engine_inner(engine, items, bar)
    r["jit_compiles"] = log.summary()
    if log.events:
        say(f"warning: {len(log.events)} kernel variant(s) compiled inside the timed run "
               f"({r['jit_compiles']['by_kernel']}): the warm-up missed them, the run's time includes them")
    return r


def run_engine_inner(engine, items, bar=None) -> dict:
    from tritune.model.engine.scheduler import SamplingParams

    pending = sorted(range(len(items)), key=lambda i: items[i].arrival)
    reqs = [None] * len(items)
    steps0, pre0 = engine.stats["steps"], engine.stats["preemptions"]
    dec0 = engine.stats["decode_tokens"]
    multi0, tm0 = engine.stats["multi_steps"], dict(engine.timings)
    engine.pool.peak_used = engine.pool.num_used
    sync()
    t0 = time.perf_counter()
    k = 0
    while k < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while k < len(pending) and items[pending[k]].arrival <= now:
            i = pending[k]
            it = items[i]
            reqs[i] = engine.add_request(it.prompt_ids, SamplingParams(max_new_tokens=it.output_len, ignore_eos=True),
                                         arrival_time=t0 + it.arrival)
            k += 1
        if engine.has_unfinished():
            engine.step()
            if bar is not None:     # decode tokens so far (each request's first token comes with its prefill)
                bar.update(engine.stats["decode_tokens"] - dec0 - bar.n)
        elif k < len(pending):
            time.sleep(max(0.0, items[pending[k]].arrival - (time.perf_counter() - t0)))
    sync()
    elapsed = time.perf_counter() - t0
    out_tok = sum(len(r.output_ids) for r in reqs)
    in_tok = sum(len(r.prompt_ids) for r in reqs)
    ttft = [r.first_token_time - r.arrival_time for r in reqs]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    return {"requests": len(reqs), "elapsed_s": elapsed, "prompt_tokens": in_tok, "output_tokens": out_tok,
            "output_tok_s": out_tok / elapsed, "total_tok_s": (in_tok + out_tok) / elapsed,
            "req_s": len(reqs) / elapsed, "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "peak_kv_blocks": engine.pool.peak_used, "kv_blocks": engine.pool.num_blocks,
            "steps": engine.stats["steps"] - steps0, "multi_steps": engine.stats["multi_steps"] - multi0,
            "preemptions": engine.stats["preemptions"] - pre0,
            "host_s": {k[:-2]: round(engine.timings[k] - tm0[k], 4) for k in tm0 if k.endswith("_s")}}


def decode_rate(engine, prompt_len=64, new_tokens=512, vocab=50257, *, desc: str = "batch-1 decode",
                show_progress: bool = False) -> dict:
    """One request alone: decode tokens/s after the first token, and where a token's time goes: on the
    graph path the GPU's share (CUDA events around the replays) and the host's phases of ``step()``."""
    import random

    from tritune.model.engine.scheduler import SamplingParams

    new_tokens = min(new_tokens, engine.config.n_positions - prompt_len)
    rnd = random.Random(1)
    engine.gpu_timing = engine.graphs is not None
    gpu0, tm0 = engine.stats["graph_gpu_s"], dict(engine.timings)
    req = engine.add_request([rnd.randrange(vocab - 1) for _ in range(prompt_len)],
                             SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    with progress(new_tokens, desc, show=show_progress) as bar:
        while engine.has_unfinished():
            engine.step()
            bar.update(len(req.output_ids) - bar.n)
    engine.gpu_timing = False
    dt = req.finish_time - req.first_token_time
    n = new_tokens - 1
    r = {"prompt_len": prompt_len, "new_tokens": new_tokens, "decode_tok_s": n / dt, "ms_per_token": dt / n * 1e3}
    tm = {k: engine.timings[k] - tm0[k] for k in tm0}
    r["host_us_per_token"] = {k[:-2]: v / n * 1e6 for k, v in tm.items() if k.endswith("_s") and v}
    if engine.graphs is not None:
        r["gpu_ms_per_token"] = (engine.stats["graph_gpu_s"] - gpu0) / n * 1e3
        r["decode_steps"] = engine.decode_steps
    return r


def say(*a):
    print(*a, flush=True)


def fill_defaults(args, gpu: bool) -> None:
    """Each option left unset takes the GPU's or the CPU's default (GPU_DEFAULTS, CPU_DEFAULTS)."""
    for k, v in (GPU_DEFAULTS if gpu else CPU_DEFAULTS).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
