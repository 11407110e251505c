"""Llama-family batch-1 decode on tritune's engine, against the weight-read floor.

A random-init checkpoint of a real model's shape (``--shape llama-3.2-1b`` | ``qwen2.5-0.5b`` | ``llama-3.1-8b``)
is written with ``transformers`` (bf16) into a temporary folder, loaded by tritune's Llama family, and served
one request at a time by the engine (CUDA graphs). Reported per shape:

- decode tok/s (tokens after the first over the time after the first), median of ``--reps`` runs;
- the floor: weight bytes / the measured copy bandwidth (``device.ceilings``: what this card moves), as tok/s,
  and decode tok/s as a share of it;
- the per-token split by kernel (torch.profiler over one request's decode), tritune's kernels marked.

``--hf`` also times transformers' ``generate`` with a static cache under ``torch.compile``
(reduce-overhead), the way its docs recommend for decode. Rows go to ``results/<gpu>/llama_decode.json``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

SHAPES = {  # HF config fields of the real models (random weights)
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=500000.0),
}


def write_checkpoint(shape: str, folder: Path) -> Path:
    import torch
    import transformers

    fields = dict(SHAPES[shape])
    kind = fields.pop("model_type")
    cfg_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg_cls(**fields, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return folder


def engine_decode(directory: Path, prompt: int, new: int, reps: int, quant: str | None = None):
    """(decode tok/s of each timed run, the engine, the bytes of the weights it serves)."""
    import torch

    from tritune.model.eval import weight_bytes

    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams
    from tritune.model.families import loader
    import json

    model_type = json.loads((directory / "config.json").read_text())["model_type"]
    model = loader(model_type)(directory, backend="triton", dtype=torch.bfloat16, device="cuda")
    if quant == "fp8":   # W8A8: the projections in e4m3 with per-channel scales, as `quant="fp8"` serves them
        from tritune.model.quant.fp8 import quantize_model

        model = quantize_model(model)
    ids = list(range(1, prompt + 1))
    for graphs in (True, False):   # CUDA graphs where the engine can capture this family, else eager
        try:
            eng = Engine(model, num_blocks=512, max_num_seqs=1, cuda_graphs=graphs)
            rates = []
            for i in range(reps + 1):
                torch.cuda.synchronize()
                req = eng.add_request(ids, SamplingParams(max_new_tokens=new, ignore_eos=True))
                eng.run()
                torch.cuda.synchronize()
                if i:   # the first run compiles and captures
                    rates.append((new - 1) / (req.finish_time - req.first_token_time))
            eng.graphs_used = graphs
            return rates, eng, weight_bytes(model.w)
        except Exception as e:  # noqa: BLE001  (reported, then the eager engine)
            if not graphs:
                raise
            print(f"cuda_graphs=True failed ({type(e).__name__}: {e}); timing the eager engine", flush=True)


def kernel_split(eng, prompt: int, new: int) -> list[dict]:
    import torch

    from tritune.harness import profiling
    from tritune.model.engine.scheduler import SamplingParams

    eng.add_request(list(range(1, prompt + 1)), SamplingParams(max_new_tokens=new, ignore_eos=True))
    eng.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        eng.run()
        torch.cuda.synchronize()
    rows, summary = profiling.kernel_table(profiling.events_of(prof), profiling.tritune_kernel_names())
    for r in rows:
        r["us_per_token"] = r["total_us"] / (new - 1)
    return rows


def hf_compiled(directory: Path, prompt: int, new: int) -> float | None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16).cuda().eval()
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.arange(1, prompt + 1, device="cuda")[None]
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new)
    for _ in range(2):
        model.generate(ids, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    model.generate(ids, **kw)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (new - 1) / ((t2 - t1) - (t1 - t0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES))
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf", action="store_true", help="also transformers + static cache + torch.compile")
    p.add_argument("--quant", choices=["fp8"], help="serve the weights quantized (the floor: their bytes)")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    from tabulate import tabulate

    from tritune.kernels.runtime import device as dev
    from tritune.model.quant.fp8 import qgemv_rows

    bw = dev.ceilings()["copy_bytes_per_s"]   # bytes a copy moves per second (read + write), as the rooflines use
    out = []
    for shape in args.shape or ["llama-3.2-1b"]:
        with tempfile.TemporaryDirectory() as tmp:
            d = write_checkpoint(shape, Path(tmp))
            weight_bytes = sum(f.stat().st_size for f in d.glob("*.safetensors"))
            rates, eng, served_bytes = engine_decode(d, args.prompt, args.new, args.reps, args.quant)
            if args.quant:   # the floor is what the engine reads: e4m3 projections, bf16 head and norms
                weight_bytes = served_bytes
            split = kernel_split(eng, args.prompt, args.new)
            graphs_used = eng.graphs_used
            del eng
            hf = hf_compiled(d, args.prompt, args.new) if args.hf else None
        floor = bw / weight_bytes
        rate = statistics.median(rates)
        row = dict(shape=shape, quant=args.quant or "none", cuda_graphs=graphs_used,
                   fp8_qgemv_rows=qgemv_rows() if args.quant else 0, weight_bytes=weight_bytes, floor_tok_s=floor,
                   decode_tok_s=rate,
                   of_floor=rate / floor, runs=rates, hf_compiled_tok_s=hf, new=args.new, prompt=args.prompt,
                   split=split[:25])
        out.append(row)
        qg = f" fp8_qgemv<={row['fp8_qgemv_rows']}" if args.quant else ""
        print(f"{shape}{' ' + args.quant if args.quant else ''}{qg}: {rate:.0f} tok/s decode, floor {floor:.0f} ({100 * rate / floor:.0f}%)"
              + (f", transformers static+compile {hf:.0f}" if hf else ""), flush=True)
        print(tabulate([[r["kernel"][:56], "yes" if r["tritune"] else "", f"{r['calls'] / (args.new - 1):.1f}",
                         f"{r['us_per_token']:.1f}", f"{100 * r['share']:.1f}%"] for r in split[:15]],
                       headers=["kernel", "tritune", "launches/token", "us/token", "share"]), flush=True)
    path = write_rows("llama_decode", out, args.results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
