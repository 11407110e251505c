"""The decode step of 1 to 8 rows as one persistent launch (``tritune.kernels.fused_decode``).

:class:`FusedDecode` holds what the kernel reads besides the step's own inputs: each kind of layer weight
stacked over layers into one tensor (a load-time copy: the kernel indexes layer l by an offset, Triton
has no array of pointers), scratch rows for q/k/v, attention output and the MLP's hidden rows, the split
partials and the barrier counters (zero between launches: the kernel's last program resets them).
:func:`fused_model` wraps a GPT2 so that ``model.decode`` takes this path for up to 8 rows: the engine's
CUDA graphs (``tritune.model.engine.graphs.DecodeGraphs``) capture it as they capture today's decode, and
today's per-op path stays the reference (and the path of larger batches and of prefill).

On a GPU every stage runs in one launch, the stages separated by grid barriers (one program per SM,
all resident). Under the interpreter (programs run one after another: a spinning program would wait
for ever) the host launches one stage at a time with the barriers compiled out: the same stage code.

The config (tile sizes, programs, K/KV splits, warps) is plain data looked up in the tuned store under
kernel name ``fused_decode`` (see :class:`tritune.kernels.fused_decode.Config`); its ``faster`` field,
written from a measured run (fused against per-op decode on that GPU), is what ``fused_decode="auto"``
follows.
"""
from __future__ import annotations

import copy
import warnings

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import torch
import triton

from tritune.kernels.runtime import device as dev
from tritune.kernels import fused_decode as FK

MAX_ROWS = 8
KERNEL = "fused_decode"
INTERPRETER_PROGRAMS = 4   # the interpreter runs programs in turn: a few exercise the split logic


def bucket(config, M: int, dtype) -> str:
    return f"E={config.n_embd},F={config.d_mlp},H={config.n_head},M={triton.next_power_of_2(M)}"


def stored_config(config, M: int, dtype) -> dict | None:
    """The tuned store's entry for this model shape and row count on this GPU (None: none stored)."""
    from tritune.kernels.runtime import store

    return store.lookup(KERNEL, bucket(config, M, dtype), dtype)


def why_not(model, kv=None) -> str | None:
    """Why this model (and cache) cannot take the fused path, or None."""
    from tritune.model.gpt2.weights import GPT2Weights

    if not isinstance(getattr(model, "w", None), GPT2Weights):
        return (f"not for this family ({getattr(model.config, 'model_type', type(model).__name__)}: the fused "
                "step is GPT-2's layer, read by its weight names)")
    c = model.config
    if getattr(model, "backend", "triton") != "triton":
        return f"backend {model.backend!r} (the fused step is a Triton kernel)"
    if model.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype {model.dtype}"
    if c.n_embd % 8 or c.d_mlp % 8:
        return f"n_embd {c.n_embd} or MLP width {c.d_mlp} not a multiple of 8 (the weight loads assume it)"
    L0 = model.w.layers[0]
    if not all(isinstance(getattr(L0, f), torch.Tensor) for f in ("w_qkv", "w_o", "w_fc", "w_proj")):
        return "quantized linears (the fused step reads dense weights)"
    if not isinstance(model.w.lm_head, torch.Tensor):
        return "a quantized LM head"
    from tritune.model.engine import invariant

    if invariant.is_invariant(model):
        return "batch-invariant mode (its reductions are pinned per row; the fused step's are not)"
    if kv is not None:
        kc, vc = kv.k_caches, kv.v_caches
        if kc[0].dtype != model.dtype:
            return f"a {kc[0].dtype} KV cache (the fused step writes and reads the model's dtype)"
        if kc[0].shape[2:] != (c.n_head, c.head_dim):
            return f"KV cache heads {tuple(kc[0].shape[2:])} differ from the model's ({c.n_head}, {c.head_dim})"
        if not all(t.is_contiguous() for t in (*kc, *vc)):
            return "a non-contiguous KV cache"
        for caches in (kc, vc):
            if len(caches) > 1:
                st = caches[1].data_ptr() - caches[0].data_ptr()
                if any(caches[i].data_ptr() - caches[0].data_ptr() != i * st for i in range(len(caches))):
                    return "per-layer KV caches not evenly spaced in one allocation"
    return None


class FusedDecode:
    """``logits = step(x, slots, block_tables, context_lens)`` for M <= ``max_rows`` rows: GPT-2's whole
    decode step (every layer, the K/V writes, the LM head) in one launch. ``x`` (M, E) contiguous is the
    embedded rows; it is overwritten (it carries the residual stream). The stacked weights are a second
    copy (GPT-2 small: +170 MB in bf16). ``share_weights``: rebind the model's layer weights to views of the
    stack instead (same values) so one copy remains; only for a caller that knows no captured CUDA graph
    still reads the old tensors (a graph keeps raw addresses, not references)."""

    def __init__(self, model, kv, *, max_rows: int = MAX_ROWS, config: dict | None = None, sync: bool | None = None,
                 share_weights: bool = False):
        why = why_not(model, kv)
        if why:
            raise ValueError(f"model: cannot take the fused decode path: {why}")
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows: expected 1..{MAX_ROWS}, got {max_rows}")
        c, w = model.config, model.w
        self.config, self.dtype, self.device = c, model.dtype, torch.device(model.device)
        self.max_rows = max_rows
        self.explicit = None if config is None else FK.Config.from_dict(config)
        # SYNC (one launch, grid barriers) needs every program resident: a GPU; the interpreter runs stages
        # one launch each
        self.sync = (not dev.interpreted()) if sync is None else sync
        E, F, L, V = c.n_embd, c.d_mlp, c.n_layer, c.vocab_size
        dt, d = self.dtype, self.device

        def stack(name):
            t = torch.stack([getattr(layer, name) for layer in w.layers]).contiguous()
            if share_weights:   # the model's own layers now read views of the stack: one copy in memory
                for i, layer in enumerate(w.layers):
                    setattr(layer, name, t[i])
            return t

        self.w = {k: stack(f) for k, f in (("LN1W", "ln1_w"), ("LN1B", "ln1_b"), ("WQKV", "w_qkv"),
                                           ("BQKV", "b_qkv"), ("WO", "w_o"), ("BO", "b_o"), ("LN2W", "ln2_w"),
                                           ("LN2B", "ln2_b"), ("WFC", "w_fc"), ("BFC", "b_fc"),
                                           ("WPROJ", "w_proj"), ("BPROJ", "b_proj"))}
        lm = w.lm_head if 1 in w.lm_head.stride() else w.lm_head.contiguous()   # unit stride along K or N
        self.w.update(LNFW=w.lnf_w, LNFB=w.lnf_b, LMH=lm, s_lk=lm.stride(0), s_ln=lm.stride(1))
        self.weight_bytes = sum(t.numel() * t.element_size() for k, t in self.w.items() if isinstance(t, torch.Tensor))
        kc, vc = kv.k_caches, kv.v_caches
        self.kv = {"KC": kc[0], "VC": vc[0], "block_size": kc[0].shape[1],
                   "s_kv_layer": (kc[1].data_ptr() - kc[0].data_ptr()) // kc[0].element_size() if L > 1 else 0}
        if L > 1 and vc[1].data_ptr() - vc[0].data_ptr() != kc[1].data_ptr() - kc[0].data_ptr():
            # the kernel steps both caches by one layer stride
            raise ValueError("kv: the K and V caches' layer strides differ")
        self.QKV = torch.empty((max_rows, 3 * E), dtype=dt, device=d)
        self.A = torch.empty((max_rows, E), dtype=dt, device=d)
        self.Hb = torch.empty((max_rows, F), dtype=dt, device=d)
        self.logits = torch.empty((max_rows, V), dtype=dt, device=d)
        self.Bar = torch.zeros(5 * L + 2, dtype=torch.int32, device=d)
        self.Dbg = torch.zeros(2, dtype=torch.int32, device=d)     # [debug spin counter, barrier timed out]
        self._plans: dict = {}
        self.Work = self.Tick = self.AWork = self.ATick = None
        for M in range(1, max_rows + 1):      # every scratch buffer at its largest now: never inside a capture
            self._plan(M)

    def check(self) -> None:
        """Raise if a barrier wait of any launch so far timed out (the grid was not all resident: its
        results are wrong). Syncs with the device: tests and benchmarks call it, the hot path does not."""
        if int(self.Dbg[1]):
            raise RuntimeError("fused decode: a grid barrier timed out (programs not all resident on the GPU); "
                               "the logits of that step are wrong")

    # ------------------------------------------------------------------------------------------------
    def config_for(self, M: int) -> FK.Config:
        if self.explicit is not None:
            return self.explicit
        stored = None if dev.interpreted() else stored_config(self.config, M, self.dtype)
        if stored is not None:
            try:
                return FK.Config.from_dict(stored)
            except ValueError as e:
                warnings.warn(f"tritune: ignoring the stored fused_decode config {stored}: {e}", stacklevel=3)
        if dev.interpreted():
            # chunks of 16 tokens: the small test contexts take both the one-chunk and the merged path
            # and the LM head in blocks of its own
            return FK.Config(block_n=32, block_k=64, block_t=16, num_warps=1, programs=INTERPRETER_PROGRAMS,
                             kv_min_chunk=16, lm_block_n=16, lm_block_k=32)
        # One row: 16 KB weight blocks (256 x 32; 233 registers a thread at 8 warps, no spill, sm90 ptxas).
        # H100, GPT-2 small: 475 us a step against 582 with 8 KB blocks (128 x 32); 256 x 64 and 512 x 32
        # within 2%. More rows (64-row tensor-core
        # tiles): 8 KB blocks, 8599 against 8344 tok/s with 256 x 64 at batch 8. The LM head in 64-wide
        # blocks (its own call site): 44.7 -> 32.8 us a step at batch 1, 8542 -> 8943 tok/s at batch 8.
        if M == 1:
            return FK.Config(block_n=32, block_k=256, block_t=32, num_warps=8, lm_block_n=64)
        return FK.Config(block_n=32, block_k=128, block_t=32, num_warps=8, lm_block_n=64)

    def _plan(self, M: int):
        p = self._plans.get(M)
        if p is not None:
            return p
        c, cfg = self.config, self.config_for(M)
        E, F, V, H = c.n_embd, c.d_mlp, c.vocab_size, c.n_head
        sms = 4 if dev.interpreted() else torch.cuda.get_device_properties(self.device).multi_processor_count
        P = min(cfg.programs or sms, sms) if self.sync else (cfg.programs or sms)
        bn = cfg.block_n
        splits = FK.plan_splits(E, F, V, cfg, P)
        n_split = FK.kv_split(M, H, P, cfg.kv_split)
        BM = FK.block_m(M, self.dtype)
        work = FK.work_floats(splits, E, F, V, cfg, P, BM)
        ticks = max(max(triton.cdiv(n, bn) for n in (3 * E, E, F, E)), triton.cdiv(V, cfg.lm_bn))
        BD = triton.next_power_of_2(c.head_dim)
        awork = M * H * n_split * (BD + 2)
        d = self.device
        if self.Work is None or self.Work.numel() < work:
            self.Work = torch.empty(work, dtype=torch.float32, device=d)
        if self.Tick is None or self.Tick.numel() < ticks:
            self.Tick = torch.zeros(ticks, dtype=torch.int32, device=d)
        if self.AWork is None or self.AWork.numel() < awork:
            self.AWork = torch.empty(awork, dtype=torch.float32, device=d)
        if self.ATick is None or self.ATick.numel() < M * H:
            self.ATick = torch.zeros(max(M * H, MAX_ROWS * H), dtype=torch.int32, device=d)
        p = (cfg, P, splits, n_split)
        self._plans[M] = p
        return p

    def __call__(self, x, slots, block_tables, context_lens, *, debug: int = 0, debug_spin: int = 0,
                 per_stage: bool | None = None, stages: int | None = None):
        """Logits (M, V) (a view of this object's buffer: valid until the next call). ``stages``: run only
        the first ``stages`` stages (timing a prefix of the step); ``per_stage``: one launch per stage
        (default: only where the barriers cannot run, the interpreter); ``debug`` see the kernel."""
        M = x.shape[0]
        if not 1 <= M <= self.max_rows:
            raise ValueError(f"x: expected 1..{self.max_rows} rows, got {M}")
        if x.dtype != self.dtype or not x.is_contiguous() or x.shape[1] != self.config.n_embd:
            raise ValueError(f"x: expected a contiguous ({M}, {self.config.n_embd}) {self.dtype} tensor, got "
                             f"{tuple(x.shape)} {x.dtype}")
        if block_tables.stride(-1) != 1:
            raise ValueError("block_tables: expected unit stride along blocks")
        cfg, P, splits, n_split = self._plan(M)
        c = self.config
        args = dict(self.w, **self.kv, X=x, QKV=self.QKV, A=self.A, Hb=self.Hb, Logits=self.logits,
                    s_log=self.logits.stride(0), Slots=slots, BT=block_tables, s_bt=block_tables.stride(0),
                    Ctx=context_lens, Work=self.Work, Tick=self.Tick, AWork=self.AWork, ATick=self.ATick,
                    Bar=self.Bar, Dbg=self.Dbg)
        kw = dict(M=M, L=c.n_layer, E=c.n_embd, F=c.d_mlp, V=c.vocab_size, H=c.n_head, D=c.head_dim,
                  eps=c.layer_norm_epsilon, cfg=cfg, programs=P, splits=splits, n_split=n_split,
                  debug=debug, debug_spin=debug_spin)
        n = 5 * c.n_layer + 1 if stages is None else stages
        per_stage = (not self.sync) if per_stage is None else per_stage
        if per_stage:
            for s in range(n):
                FK.launch(args, sync=False, stage_lo=s, stage_hi=s + 1, **kw)
        else:
            FK.launch(args, sync=self.sync, stage_lo=0, stage_hi=n, **kw)
        return self.logits[:M]


def fused_model(model, kv, *, max_rows: int = MAX_ROWS, config: dict | None = None):
    """``model`` whose ``decode`` runs steps of up to ``max_rows`` rows as one fused launch (larger
    batches: the model's own decode). Weights are stacked once here."""
    fd = FusedDecode(model, kv, max_rows=max_rows, config=config)
    m = copy.copy(model)
    base = model.decode

    @torch.inference_mode()
    def decode(input_ids, positions, kv_cache, slot_mapping, block_tables, context_lens, *, x=None):
        B = slot_mapping.shape[0]
        if B > fd.max_rows or kv_cache is not kv:
            return base(input_ids, positions, kv_cache, slot_mapping, block_tables, context_lens, x=x)
        if x is None:
            x = model.embed(input_ids.reshape(B), positions.reshape(B))
        return fd(x.contiguous(), slot_mapping, block_tables, context_lens)

    m.decode = decode
    m.fused = fd
    return m


def choose(model, kv, fused_decode, max_rows: int) -> tuple[bool, str]:
    """Whether the runner takes the fused path, and why. ``fused_decode``: True (always, when the model
    can), False, or "auto": on where the tuned store's entry for this GPU and shape says it measured faster
    (``faster: 1``); no entry: today's path."""
    if fused_decode not in (True, False, "auto"):
        raise ValueError(f"fused_decode: expected True, False or 'auto', got {fused_decode!r}")
    if not fused_decode:
        return False, "fused decode off"
    why = why_not(model, kv)
    if why:
        return False, f"fused decode off: {why}"
    if fused_decode == "auto":
        stored = None if dev.interpreted() else stored_config(model.config, 1, model.dtype)
        if not stored or not stored.get("faster"):
            return False, "fused decode off: not measured faster on this GPU (no stored config marked faster)"
    return True, f"fused decode: one persistent launch per step at batch <= {min(max_rows, MAX_ROWS)}"
