"""GEMM's problems and cases: the problem type, the inputs the tests, the benchmark and the tuner launch on
(with the LayerNorm / RMSNorm and KV-cache fusions' arguments), the hypothesis strategy of problems, GPT-2's
linears and Llama-3.2-1B's SwiGLU projection as standard problems, the vendor (cuBLAS through torch, op by
op) and FlagGems' peer, and the bad arguments the launcher must refuse. The kernel, its launcher and its config space are in :mod:`tritune.kernels.gemm`, which
registers the spec; this module registers none.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S

ACTIVATIONS = (None, "gelu_tanh", "swiglu")


@dataclass(frozen=True)
class Problem:
    M: int                       # rows of A and C (all leading dims of A flattened)
    N: int                       # columns of B (with act "swiglu" the [gate | up] 2F; C has N / 2)
    K: int
    trans_a: bool = False        # A is a column-major view (the transpose of a row-major (K, M))
    trans_b: bool = False        # B is a column-major view (e.g. a tied embedding (N, K) read as its .t())
    bias: bool = False
    act: str | None = None       # None, "gelu_tanh" or "swiglu"
    residual: bool = False
    batch: int = 1               # A is (batch, M / batch, K) when > 1
    ln: bool = False             # a LayerNorm (weight and bias) of each row of A over K first
    kv: bool = False             # N = 3·C: the K/V columns also written to paged caches (a qkv projection)
    rms: bool = False            # an RMSNorm (weight) of each row of A over K first (instead of ln)

    @property
    def n_out(self) -> int:
        """Columns of C."""
        return self.N // 2 if self.act == "swiglu" else self.N


def problem_of(a, b, bias=None, *, activation=None, residual=None, ln=None, kv=None, rms=None, **_) -> Problem:
    kdim = a.shape[-1]
    return Problem(math.prod(a.shape[:-1]), b.shape[-1], kdim, trans_a=a.stride(-1) != 1,
                   trans_b=b.stride(1) != 1, bias=bias is not None, act=activation,
                   residual=residual is not None, batch=a.shape[0] if a.dim() == 3 else 1,
                   ln=ln is not None, kv=kv is not None, rms=rms is not None)


def operand(rows: int, cols: int, trans: bool, batch: int, dtype, device, seed: int, layout: str,
             scale: float, shift: float = 0.0) -> torch.Tensor:
    """A (batch ×) rows × cols operand; ``trans`` stores it column-major (a transposed view)."""
    lead = (batch,) if batch > 1 else ()
    shape = (*lead, cols, rows) if trans else (*lead, rows, cols)
    t = S.with_layout(S.randn(shape, dtype, device, seed, scale=scale, shift=shift), layout)
    return t.transpose(-1, -2) if trans else t


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    batch = p.batch if p.batch > 1 and p.M % p.batch == 0 else 1
    # B scaled by 1/sqrt(K): pre-activations O(1), where GELU bends
    # with ln: rows with a mean and a spread (what LN removes); with rms: rows of any scale
    norm = p.ln or p.rms
    a = operand(p.M // batch, p.K, p.trans_a, batch, dtype, device, seed, layout, *((2.0, 0.5) if norm else (1.0,)))
    b = operand(p.K, p.N, p.trans_b, 1, dtype, device, seed + 1, layout, 1.0 / math.sqrt(p.K))
    bias = S.randn((p.N,), dtype, device, seed + 2, scale=0.5) if p.bias else None
    out_shape = (*a.shape[:-1], p.n_out)
    res = S.randn(out_shape, dtype, device, seed + 3) if p.residual else None
    ln = kv = None
    if p.ln:  # weights around 1
        ln = (S.randn((p.K,), dtype, device, seed + 4, scale=0.2, shift=1.0),
              S.randn((p.K,), dtype, device, seed + 5, scale=0.1), 1e-5)
    if p.kv:
        kv = kv_cache_inputs(p.M, p.N, dtype, device, seed + 6)
    kwargs = {"activation": p.act, "residual": res, "ln": ln, "kv": kv}
    if p.rms:  # only then: the cases of the other problems keep the keywords they had
        kwargs["rms"] = (S.randn((p.K,), dtype, device, seed + 4, scale=0.2, shift=1.0), 1e-6)
    return K.Case(args=(a, b, bias), kwargs=kwargs, out=torch.empty(out_shape, dtype=dtype, device=device))


def kv_cache_inputs(m: int, n: int, dtype, device, seed: int, block_size: int = 4):
    """(k_cache, v_cache, slot_mapping) for an (m, n = 3·C) qkv output: caches of 2 heads when C is even,
    NaN-filled (a slot written by mistake shows), one slot per row in a shuffled order, every fifth -1."""
    if n % 3:
        raise ValueError(f"kv: N={n} is not 3 x heads x head_dim")
    c = n // 3
    heads = 2 if c % 2 == 0 else 1
    blocks = -(-(m + 3) // block_size)
    cache = torch.full((blocks, block_size, heads, c // heads), float("nan"), dtype=dtype, device=device)
    g = S.generator(seed, "cpu")
    slots = torch.randperm(blocks * block_size, generator=g)[:m]
    slots[::5] = -1
    return cache, cache.clone(), slots.to(device=device, dtype=torch.int32 if seed % 2 else torch.int64)


def problems(max_elems: int):
    """Sizes up to max_elems^(1/3) per dim (25 on the interpreter), every epilogue, both transpositions,
    with the LayerNorm, the RMSNorm or no prologue, with and without the KV-cache write (N rounded to a
    multiple of 3; never with SwiGLU, whose N is rounded to even)."""
    from hypothesis import strategies as st

    d = max(2, round(max_elems ** (1 / 3)))

    @st.composite
    def draw(dr):
        m, n, k = dr(S.sizes(d)), dr(S.sizes(d)), dr(S.sizes(d))
        batch = dr(st.sampled_from([b for b in (1, 2, 3) if m % b == 0]))
        norm, act = dr(st.sampled_from([None, "ln", "rms"])), dr(st.sampled_from(ACTIVATIONS))
        kv = act != "swiglu" and dr(st.booleans())
        if kv:
            n = 3 * max(1, n // 3)
        if act == "swiglu":
            n = 2 * max(1, n // 2)
        return Problem(m, n, k, trans_a=dr(st.booleans()), trans_b=dr(st.booleans()), bias=dr(st.booleans()),
                       act=act, residual=dr(st.booleans()), batch=batch, ln=norm == "ln", kv=kv, rms=norm == "rms")

    return draw()


def vendor(c: K.Case):
    """cuBLAS through PyTorch plus the same epilogue, op by op (what a PyTorch model runs): F.layer_norm or
    F.rms_norm first, SwiGLU as F.silu(g) * u of the product's halves (addmm / mm is what F.linear runs),
    and the cache write an index_copy_ of the live rows (found once, outside the timed call)."""
    a, b, bias = c.args
    act, res, ln, kv = c.kwargs["activation"], c.kwargs["residual"], c.kwargs.get("ln"), c.kwargs.get("kv")
    rms = c.kwargs.get("rms")
    F = torch.nn.functional
    a2 = a.reshape(-1, a.shape[-1])
    r2 = res.reshape(a2.shape[0], -1) if res is not None else None
    if kv is not None:
        kc, vc, slots = kv
        live = (slots >= 0).nonzero().flatten()
        at, cn = slots[live].long(), kc.shape[2] * kc.shape[3]

    def run():
        h = a2 if ln is None else F.layer_norm(a2, (a2.shape[-1],), ln[0], ln[1], ln[2])
        if rms is not None:
            h = F.rms_norm(a2, (a2.shape[-1],), rms[0], rms[1])
        y = torch.addmm(bias, h, b) if bias is not None else torch.mm(h, b)
        if act == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        elif act == "swiglu":
            g, u = y.chunk(2, dim=-1)
            y = F.silu(g) * u
        if r2 is not None:
            y += r2
        if kv is not None:
            yl = y[live]
            kc.view(-1, cn).index_copy_(0, at, yl[:, cn:2 * cn])
            vc.view(-1, cn).index_copy_(0, at, yl[:, 2 * cn:])
        return y

    return run


# FlagGems' mm autotunes every new (M, N, K) over its whole list (22 configs for its pointer kernel, ~150
# for its Hopper TMA kernel): minutes of compiling per shape, more than a benchmark run has. As a peer it
# runs with its autotuner held to these of its own configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages), the usual winners of each size class; it still picks among them by timing.
FLAG_GEMS_CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4),
                     (128, 64, 64, 4, 4), (32, 64, 256, 4, 4), (16, 64, 256, 4, 4), (16, 64, 128, 2, 4))
FLAG_GEMS_MAX = 6


@functools.lru_cache(maxsize=None)
def flag_gems_mm():
    """flag_gems.mm with its autotuners' config lists cut to FLAG_GEMS_CONFIGS (at most FLAG_GEMS_MAX
    each); None when FlagGems is not installed."""
    try:
        import flag_gems
    except Exception:
        return None
    import sys

    mod = sys.modules.get(getattr(flag_gems.mm, "__module__", ""))
    for name in dir(mod) if mod is not None else ():
        tuner = getattr(getattr(mod, name), "fn", None)  # libentry(libtuner(jit)): the tuner is .fn
        configs = getattr(tuner, "configs", None)
        if not isinstance(configs, list) or len(configs) <= FLAG_GEMS_MAX:
            continue

        def sig(cf):
            kw = getattr(cf, "kwargs", {})
            return (kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("BLOCK_K"), cf.num_warps, cf.num_stages)

        keep = [cf for cf in configs if sig(cf) in FLAG_GEMS_CONFIGS][:FLAG_GEMS_MAX]
        tuner.configs = keep or configs[:FLAG_GEMS_MAX]
    return flag_gems.mm


def flag_gems(c: K.Case):
    a, b, bias = c.args
    if (bias is not None or c.kwargs["activation"] or c.kwargs["residual"] is not None
            or c.kwargs.get("ln") is not None or c.kwargs.get("kv") is not None or c.kwargs.get("rms") is not None):
        return None  # plain matmul only
    mm = flag_gems_mm()
    if mm is None:
        return None
    a2 = a.reshape(-1, a.shape[-1])
    return lambda: mm(a2, b)


def bad_inputs(gemm, device):
    """(label, thunk, exception) of arguments ``gemm`` must refuse with a message naming the argument."""
    a = torch.randn(4, 8, device=device)
    b = torch.randn(8, 5, device=device)
    b6 = torch.randn(8, 6, device=device)
    kc = torch.zeros(3, 4, 1, 2, device=device)
    slots = torch.zeros(4, dtype=torch.int32, device=device)
    return [
        ("inner sizes differ", lambda: gemm(a, torch.randn(7, 5, device=device)), ValueError),
        ("dtype mismatch", lambda: gemm(a, b.half()), TypeError),
        ("integer a", lambda: gemm(a.to(torch.int32), b), TypeError),
        ("float64 a", lambda: gemm(a.double(), b.double()), TypeError),
        ("a on the wrong device", lambda: gemm(a.to("meta"), b), ValueError),
        ("b on another device than a", lambda: gemm(a, b.to("meta")), ValueError),
        ("b not 2-D", lambda: gemm(a, b[None]), ValueError),
        ("a a scalar", lambda: gemm(torch.tensor(1.0, device=device), b), ValueError),
        ("a not a tensor", lambda: gemm([[1.0]], b), TypeError),
        ("bias of the wrong length", lambda: gemm(a, b, torch.randn(6, device=device)), ValueError),
        ("bias 2-D", lambda: gemm(a, b, torch.randn(1, 5, device=device)), ValueError),
        ("bias of another dtype", lambda: gemm(a, b, torch.randn(5, device=device).half()), TypeError),
        ("residual of the wrong shape", lambda: gemm(a, b, residual=torch.randn(4, 6, device=device)), ValueError),
        ("residual of another dtype", lambda: gemm(a, b, residual=torch.randn(4, 5, device=device).half()), TypeError),
        ("unknown activation", lambda: gemm(a, b, activation="relu"), ValueError),
        ("out of the wrong shape", lambda: gemm(a, b, out=torch.empty(4, 6, device=device)), ValueError),
        ("ln not a triple", lambda: gemm(a, b, ln=(None, None)), TypeError),
        ("ln weight of the wrong length", lambda: gemm(a, b, ln=(torch.randn(7, device=device), None, 1e-5)),
         ValueError),
        ("ln eps negative", lambda: gemm(a, b, ln=(None, None, -1.0)), ValueError),
        ("kv not a triple", lambda: gemm(a, b6, kv=(kc, kc)), TypeError),
        ("kv with N not 3 x heads x head_dim", lambda: gemm(a, b, kv=(kc, kc, slots)), ValueError),
        ("kv slots of the wrong length", lambda: gemm(a, b6, kv=(kc, kc, slots[:1])), ValueError),
        ("kv cache of another dtype", lambda: gemm(a, b6, kv=(kc.half(), kc.half(), slots)), TypeError),
        ("kv slots of a float dtype", lambda: gemm(a, b6, kv=(kc, kc, slots.float())), TypeError),
        ("swiglu with an odd N", lambda: gemm(a, b, activation="swiglu"), ValueError),
        ("swiglu with the KV-cache write", lambda: gemm(a, b6, activation="swiglu", kv=(kc, kc, slots)), ValueError),
        ("swiglu residual of the whole N",
         lambda: gemm(a, b6, activation="swiglu", residual=torch.randn(4, 6, device=device)), ValueError),
        ("rms not a pair", lambda: gemm(a, b, rms=(None, None, 1e-6)), TypeError),
        ("rms and ln together", lambda: gemm(a, b, ln=(None, None, 1e-5), rms=(None, 1e-6)), ValueError),
        ("rms weight of the wrong length", lambda: gemm(a, b, rms=(torch.randn(7, device=device), 1e-6)), ValueError),
        ("rms eps negative", lambda: gemm(a, b, rms=(None, -1.0)), ValueError),
    ]


def gpt2(m: int) -> list[Problem]:
    """GPT-2 small's linears as the model runs them: c_attn (bias), attn c_proj (bias + residual),
    mlp c_fc (bias + GELU), mlp c_proj (bias + residual), the tied LM head (x @ wte.T, no bias)."""
    return [Problem(m, 2304, 768, bias=True),
            Problem(m, 768, 768, bias=True, residual=True),
            Problem(m, 3072, 768, bias=True, act="gelu_tanh"),
            Problem(m, 768, 3072, bias=True, residual=True),
            Problem(m, 50257, 768, trans_b=True)]


def gpt2_fused(m: int) -> list[Problem]:
    """The decode linears with what the batch-invariant mode fuses into them (model/invariant.py):
    ln_1 + c_attn + the KV-cache write, ln_2 + c_fc + GELU, ln_f + the tied LM head."""
    return [Problem(m, 2304, 768, bias=True, ln=True, kv=True),
            Problem(m, 3072, 768, bias=True, act="gelu_tanh", ln=True),
            Problem(m, 50257, 768, trans_b=True, ln=True)]


def llama_swiglu(m: int) -> Problem:
    """Llama-3.2-1B's gate/up projection with SwiGLU fused (hidden 2048, intermediate 8192: B is the
    (2048, 16384) [gate | up] weight, C has 8192 columns)."""
    return Problem(m, 16384, 2048, act="swiglu")
