"""INT8 / INT4 checkpoints of the Llama family (Llama, Qwen2/3, Mistral) in Hugging Face's GPTQ layout.

``tritune quantize DIR --method rtn|gptq`` on a Llama-family checkpoint quantizes each ``nn.Linear`` of the
decoder layers (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``) on its own and writes, in place
of its ``weight``, GPTQ's ``qweight``/``qzeros``/``scales``/``g_idx`` (:func:`tritune.model.quant.hf.to_hf`);
embeddings, norms, biases and the LM head stay dense. ``--method gptq`` collects each linear's Hessian
from calibration text run through transformers' model of the checkpoint, one decoder layer at a time,
every earlier layer already replaced by its quantized weights (q, k, v share one Hessian, as gate and up
do). ``--method awq`` (int4) searches per-input-channel scales on the same layer inputs and folds them into
what feeds each group of linears (input_layernorm -> q, k, v; v -> o where the heads are not grouped;
post_attention_layernorm -> gate, up; up -> down), clips each group's range (q and k not: their error
shows only through the scores) and writes AWQ's gemm layout.

The family's loader runs such checkpoints, and GPTQ or AWQ (gemm) checkpoints of the family written by
other tools: q, k, v are fused into tritune's one qkv linear and gate, up into one gate/up linear, so
their column order must agree; an act-order (``desc_act``) checkpoint that permutes them differently is
refused by name.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from tritune.model.quant import hf as hf_quant
from tritune.references import quant as Q

# tritune's fused linears (LayerWeights fields) -> the checkpoint's modules, in column order
FUSED = {"w_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "w_o": ("self_attn.o_proj",),
         "w_gu": ("mlp.gate_proj", "mlp.up_proj"),
         "w_down": ("mlp.down_proj",)}
# the modules whose input each Hessian is (k and v see q's input, up sees gate's)
SHARED_INPUT = {"self_attn.q_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",),
                "mlp.gate_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}
MAX_CALIB_LEN = 2048


def group_for(K: int, spec, name: str) -> int:
    """The group of a K-wide linear: K for int8; for int4 the largest supported size <= the asked one
    that divides K."""
    if spec.bits == 8:
        return K
    g = Q.group_for(K, spec.group_size)
    if g is None:
        raise ValueError(f"{name}: int4 needs K ({K}) to be a multiple of a group size in {Q.INT4_GROUP_SIZES}")
    return g


# ---------------------------------------------------------------------------------------------------
# Quantizing
# ---------------------------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by a hook to end a calibration forward once the layer studied has run."""


def through_layer(model, layer: int, batches, on_input) -> None:
    """Run the calibration batches through the model up to decoder layer ``layer`` (the forward stopped after
    it), calling ``on_input(module, x)`` with each of its hooked linears' (n, K) inputs."""
    layers = model.model.layers
    block = layers[layer]

    def collect(name):
        def pre(_mod, args):
            on_input(name, args[0].detach().reshape(-1, args[0].shape[-1]))
        return pre

    def stop(*_):
        raise _Stop

    hooks = [block.get_submodule(name).register_forward_pre_hook(collect(name)) for name in SHARED_INPUT]
    after = layers[layer + 1] if layer + 1 < len(layers) else model.model.norm
    hooks.append(after.register_forward_pre_hook(stop))
    try:
        with torch.inference_mode():
            for ids in batches:
                try:
                    model(input_ids=ids, use_cache=False)
                except _Stop:
                    pass
    finally:
        for h in hooks:
            h.remove()


def layer_hessians(model, layer: int, batches) -> dict:
    """{module: 2 XᵀX / n} of one decoder layer's linears' inputs (float64)."""
    sums, counts = {}, {}

    def add(name, x):
        x = x.double()
        sums[name] = sums.get(name, 0) + x.t() @ x
        counts[name] = counts.get(name, 0) + x.shape[0]

    through_layer(model, layer, batches, add)
    return {n: (2.0 / counts[n]) * sums[n] for n in sums}


def layer_inputs(model, layer: int, batches, rows: int = 4096, seed: int = 0) -> dict:
    """{module: (n, K) float32} inputs of one decoder layer's linears, at most ``rows`` of them, drawn evenly
    from the batches."""
    got = {}
    per = max(1, rows // max(1, len(batches)))
    gen = torch.Generator().manual_seed(seed + layer)

    def keep(name, x):
        x = x.float()
        if x.shape[0] > per:
            x = x[torch.randperm(x.shape[0], generator=gen)[:per]]
        got.setdefault(name, []).append(x)

    through_layer(model, layer, batches, keep)
    return {n: torch.cat(v) for n, v in got.items()}


def awq_fold(block, xs: dict, spec, grouped_heads: bool, name: str) -> dict:
    """AWQ's scales of one block searched and folded into its weights in place; returns each linear's
    input after the folds (what its clipping search sees)."""
    from tritune.model.quant import quantize as QZ

    def w(n):
        return block.get_submodule(n).weight.data

    def search(names, x, what):
        ws = torch.cat([w(n) for n in names])
        return QZ.awq_scale(ws, x, spec, group_for(ws.shape[1], spec, f"{name}.{what}"))

    def into_rows(n, s):        # a linear whose outputs feed the scaled inputs: rows (and bias) / s
        lin = block.get_submodule(n)
        lin.weight.data.div_(s[:, None])
        if lin.bias is not None:
            lin.bias.data.div_(s)

    qkv, gu = SHARED_INPUT["self_attn.q_proj"], SHARED_INPUT["mlp.gate_proj"]
    s = search(qkv, xs["self_attn.q_proj"], "qkv")
    block.input_layernorm.weight.data.div_(s)
    for n in qkv:
        w(n).mul_(s[None, :])
    x_attn, x_o = xs["self_attn.q_proj"] / s, xs["self_attn.o_proj"]
    if not grouped_heads:     # v's rows feed o's columns one to one only without grouped KV heads
        s = search(("self_attn.o_proj",), x_o, "o_proj")
        into_rows("self_attn.v_proj", s)
        w("self_attn.o_proj").mul_(s[None, :])
        x_o = x_o / s
    s = search(gu, xs["mlp.gate_proj"], "gate_up")
    block.post_attention_layernorm.weight.data.div_(s)
    for n in gu:
        w(n).mul_(s[None, :])
    x_mlp = xs["mlp.gate_proj"] / s
    s = search(("mlp.down_proj",), xs["mlp.down_proj"], "down_proj")
    into_rows("mlp.up_proj", s)
    w("mlp.down_proj").mul_(s[None, :])
    return {"self_attn.q_proj": x_attn, "self_attn.k_proj": x_attn, "self_attn.v_proj": x_attn,
            "self_attn.o_proj": x_o, "mlp.gate_proj": x_mlp, "mlp.up_proj": x_mlp,
            "mlp.down_proj": xs["mlp.down_proj"] / s}


def quantize_one(w, spec, g: int, h=None, x=None, name: str = ""):
    """One (N, K) weight: rtn, gptq (Hessian ``h``) or awq's clipped rounding (inputs ``x``; q and k unclipped)."""
    from tritune.model.quant import quantize as QZ

    if spec.method == "gptq":
        return QZ.gptq(w, h, spec, g)
    if spec.method == "awq":
        clip = not name.endswith(("q_proj", "k_proj"))
        shrink = QZ.awq_clip(w, x, spec, g) if clip else torch.ones(w.shape[0], w.shape[1] // g)
        return QZ.quantize_clipped(w, shrink, spec, g)
    return QZ.rtn(w, spec, g)


def quantize_layers(directory, spec, ids, *, progress: bool = True) -> dict:
    """{"layers.{i}.{module}": QuantizedWeight} for every decoder linear (``ids``: (n, T) calibration
    windows; rtn needs none)."""
    import transformers
    from tqdm import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    c = model.config
    grouped = c.num_key_value_heads != c.num_attention_heads
    n_layers = len(model.model.layers)
    out = {}
    bar = tqdm(total=n_layers * 7, desc=f"{spec.method} int{spec.bits}", disable=not progress, file=sys.stderr,
               unit="linear")
    batches = [] if ids is None else list(ids.split(8))
    for i in range(n_layers):
        block = model.model.layers[i]
        hs = layer_hessians(model, i, batches) if spec.method == "gptq" else {}
        xs = awq_fold(block, layer_inputs(model, i, batches), spec, grouped, f"layers.{i}") \
            if spec.method == "awq" else {}
        for first, names in SHARED_INPUT.items():
            for name in names:
                lin = block.get_submodule(name)
                w = lin.weight.detach().float()
                g = group_for(w.shape[1], spec, f"layers.{i}.{name}")
                qw = quantize_one(w, spec, g, hs.get(first), xs.get(name), name)
                lin.weight.data.copy_(qw.dequantize(torch.float32))  # the next layers see the quantized ones
                out[f"layers.{i}.{name}"] = qw
                bar.update()
    bar.close()
    dense = None
    if spec.method == "awq":   # the folds changed norms and biases: the dense tensors come from the model
        tied = bool(getattr(c, "tie_word_embeddings", False))
        dense = {(k[len("model."):] if k.startswith("model.") else k): v.detach()
                 for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return out, dense


def quantize_checkpoint(directory, out, spec, *, calib=None, n_samples: int = 128, seq_len: int | None = None,
                        seed: int = 0, checkpoint_format: str = "auto", progress: bool = True) -> Path:
    """Quantize a Llama-family checkpoint with ``spec`` into ``out`` (rtn, gptq: GPTQ's layout; awq: AWQ's)."""
    from tritune.model.llama import weights as LW
    from tritune.model.llama.config import LlamaConfig
    from tritune.model.quant import quantize as QZ
    from tritune.model.tokenizer import Tokenizer

    spec.validate()
    directory = Path(directory)
    config = LlamaConfig.from_file(directory / "config.json")
    for K, what in ((config.n_embd, "hidden_size"), (config.n_head * config.head_dim, "the attention output"),
                    (config.d_mlp, "intermediate_size")):
        group_for(K, spec, what)           # before any work: every linear's K takes a group
    T = seq_len or min(config.n_positions, MAX_CALIB_LEN)
    if not 1 <= T <= config.n_positions:
        raise ValueError(f"seq_len: expected 1..{config.n_positions}, got {T}")
    torch.manual_seed(seed)
    ids, calib_name = None, None
    if spec.method != "rtn":
        stream, calib_name = QZ.calibration_text(Tokenizer.from_dir(directory), calib)
        ids = QZ.windows(stream, n_samples, T, seed)
    qws, dense = quantize_layers(directory, spec, ids, progress=progress)
    source = LW.load_state_dict(directory)
    if dense is not None:      # AWQ's folded norms and biases, in the source's dtype
        dtype = next(iter(source.values())).dtype
        dense = {k: v.to(dtype) for k, v in dense.items()}
    q = {"bits": spec.bits, "group_size": spec.group_size if spec.bits == 4 else -1, "lm_head": False,
         "tritune": {"method": spec.method, "calib": calib_name, "n_samples": n_samples if ids is not None else 0,
                     "seq_len": T, "seed": seed}}
    if spec.method == "awq":
        q.update(quant_method="awq", zero_point=not spec.sym, version="gemm")
    else:
        if checkpoint_format == "auto":
            v1 = all(w.bits == 8 or int(w.zeros.min()) >= 1 for w in qws.values())
            checkpoint_format = "gptq" if v1 else "gptq_v2"
        q.update(quant_method="gptq", sym=spec.sym or spec.bits == 8, desc_act=False, damp_percent=spec.damp,
                 true_sequential=False, checkpoint_format=checkpoint_format)
    return write(out, directory, source if dense is None else dense, qws, q)


def write(out, src_dir: Path, dense: dict, qws: dict, q: dict) -> Path:
    """The checkpoint: ``dense`` (the source's tensors, ``model.`` stripped) with each quantized module's
    ``weight`` replaced by its GPTQ tensors; config.json with ``quantization_config``; the tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in dense.items():
        module = name.rsplit(".", 1)[0]
        if module in qws and name.endswith(".weight"):
            continue
        state[name if name.startswith("lm_head") else "model." + name] = t.contiguous()
    for module, qw in qws.items():
        for tn, t in hf_quant.to_hf(qw, q["quant_method"], q.get("checkpoint_format", "gptq")).items():
            state[f"model.{module}.{tn}"] = t.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg["quantization_config"] = q
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in hf_quant.COPY_FILES + ("tokenizer_config.json", "special_tokens_map.json"):
        if (src_dir / f).is_file():
            shutil.copyfile(src_dir / f, out / f)
    return out


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------
def fuse(parts: list, name: str):
    """QuantizedWeights of one input stacked along their outputs (q, k, v -> qkv), as one."""
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(p, hf_quant.ActOrderWeight) for p in parts):
        raise ValueError(f"{name}: an act-order (desc_act) checkpoint whose fused projections permute their "
                         "columns is not supported for the Llama family")
    bits, K, g = parts[0].bits, parts[0].K, parts[0].group_size
    if any((p.bits, p.K, p.group_size) != (bits, K, g) for p in parts):
        raise ValueError(f"{name}: its projections differ in bits or group size; tritune fuses them")
    N = sum(p.N for p in parts)
    if bits == 8:
        return Q.QuantizedWeight(8, N, K, K, torch.cat([p.data for p in parts]).contiguous(),
                                 torch.cat([p.scales for p in parts]).contiguous(), None)
    codes = torch.cat([p.codes() for p in parts]).to(torch.uint8)
    sb = torch.cat([p.scales.contiguous() for p in parts]).contiguous()
    zeros = torch.cat([p.zeros.contiguous() for p in parts]).contiguous()
    scales, zp = Q.scale_zero_views(Q.pack_scale_zero(sb, zeros))
    qw = Q.QuantizedWeight(4, N, K, g, Q.to_panels(Q.pack_int4(codes, g), g), scales, zp)
    qw.validate()
    return qw


def load(directory, dtype: torch.dtype = torch.float32, device="cpu"):
    """(LlamaConfig, LlamaWeights with quantized linears, directory) from a GPTQ/AWQ checkpoint of the family."""
    from tritune.model.llama import weights as LW
    from tritune.model.llama.config import LlamaConfig

    directory = Path(directory)
    q = hf_quant.quantization_config(directory)
    hf_quant.check_qcfg(q, str(directory / "config.json"))
    d = {k: v for k, v in json.loads((directory / "config.json").read_text()).items() if k != "quantization_config"}
    c = LlamaConfig.from_dict(d, str(directory / "config.json")).with_generation_eos(
        directory / "generation_config.json")
    raw = LW.load_state_dict(directory)

    def dense(name):
        if name not in raw:
            raise ValueError(f"{directory}: tensor {name!r} missing")
        return raw[name].to(device=device, dtype=dtype).contiguous()

    def bias(i, modules):
        names = [f"layers.{i}.{m}.bias" for m in modules]
        return torch.cat([dense(n) for n in names]).contiguous() if names[0] in raw else None

    sizes = {"self_attn.q_proj": c.n_head * c.head_dim, "self_attn.k_proj": c.n_kv_head * c.head_dim,
             "self_attn.v_proj": c.n_kv_head * c.head_dim, "self_attn.o_proj": c.n_embd,
             "mlp.gate_proj": c.d_mlp, "mlp.up_proj": c.d_mlp, "mlp.down_proj": c.n_embd}
    ins = {"self_attn.o_proj": c.n_head * c.head_dim, "mlp.down_proj": c.d_mlp}
    layers = []
    for i in range(c.n_layer):
        lin = {}
        for field, modules in FUSED.items():
            parts = []
            for m in modules:
                pre = f"layers.{i}.{m}"
                t = {k: raw[f"{pre}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx") if f"{pre}.{k}" in raw}
                parts.append(hf_quant.from_hf(t, q, sizes[m], ins.get(m, c.n_embd), pre))
            lin[field] = fuse(parts, f"layers.{i}.{field}").to(device)
        layers.append(LW.LayerWeights(
            ln1_w=dense(f"layers.{i}.input_layernorm.weight"), b_qkv=bias(i, FUSED["w_qkv"]),
            b_o=bias(i, FUSED["w_o"]), ln2_w=dense(f"layers.{i}.post_attention_layernorm.weight"),
            b_gu=bias(i, FUSED["w_gu"]), b_down=bias(i, FUSED["w_down"]),
            q_norm=dense(f"layers.{i}.self_attn.q_norm.weight") if c.qk_norm else None,
            k_norm=dense(f"layers.{i}.self_attn.k_norm.weight") if c.qk_norm else None, **lin))
    wte = dense("embed_tokens.weight")
    if "lm_head.qweight" in raw:       # a checkpoint whose LM head is quantized too ("lm_head": true)
        t = {k: raw[f"lm_head.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx") if f"lm_head.{k}" in raw}
        head = hf_quant.from_hf(t, q, c.vocab_size, c.n_embd, "lm_head").to(device)
    else:
        head = wte.t() if c.tie_word_embeddings else dense("lm_head.weight").t()
    return c, LW.LlamaWeights(wte=wte, layers=layers, lnf_w=dense("norm.weight"), lm_head=head), directory


def load_model(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """A :class:`~tritune.model.llama.model.Llama` running a GPTQ/AWQ checkpoint's linears on the quant kernels."""
    from tritune.model.gpt2.model import default_device
    from tritune.model.llama.model import Llama
    from tritune.model.quant import ops as quant_ops

    c, w, d = load(directory, dtype, default_device(backend) if device is None else device)
    return quant_ops.with_quantized_weights(Llama(c, w, backend=backend, directory=d), w)
