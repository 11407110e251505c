"""Fused attention forward for prefill: out = softmax(q kᵀ · scale + mask) v, flash-attention style; two specs,
``attention`` over (B, H, T, D) tensors (:mod:`.dense`) and ``attention_varlen`` over packed sequences
(:mod:`.varlen`), registered when this package is imported.

Two implementations, picked by the config key ``IMPL`` and tuned like the rest of the space (:mod:`.space`):

- "triton" (:mod:`.triton_fwd`): one program owns BLOCK_M query rows of one head and streams the keys and
  values past them with an online softmax; fp32 dots follow ``torch.get_float32_matmul_precision()`` (IEEE
  under "highest", tf32 under "high"/"medium"). ``TMA`` picks how tiles move on the Hopper path (0 pointers;
  1 descriptors made by each program on the device; 2 descriptors made once on the host over the 4-D
  tensors, dense only); ``SCHEDULE`` the unmasked key loop's order ("pipelined", "warp_specialized",
  "ahead"); ``LAZY_RESCALE=1`` rescales the accumulator only when a row max grew by more than 2^8. A layout
  TMA cannot read (D not unit-stride, rows or bases not 16-byte aligned) runs the pointer path.
- "gluon" (:mod:`.gluon`, sm90 GPUs, fp16/bf16): FlashAttention-3's structure written in Gluon, two consumer
  warpgroups (or three with BLOCK_M=192, FA3's CTA at D <= 64) and a one-warp TMA producer in
  warp-specialized partitions; ``SCHEDULE`` "ahead", "intra_wg" or "pingpong"; ``PERSISTENT=1`` its
  persistent form (dense only: one CTA per SM over the work items), which hides each tile's prologue and
  epilogue behind the next tile's loads. A call it does not take (a scale <= 0, a layout or base TMA cannot
  read, a dense call without keys, the interpreter) runs the Triton kernel with the default config instead.

Causal alignment puts the queries at the end of the keys: query i sees key j when j <= i + Tk − Tq; a row
that sees no key outputs 0 and its lse is −inf. GQA/MQA: query head h reads kv head h // (Hq / Hkv).

Stored configs of the single ``WARP_SPEC`` key that these keys replace translate with :mod:`.migrate`.
"""
from tritune.kernels.attention import gluon as G, gluon_launch  # noqa: F401
from tritune.kernels.attention.dense import PLANS, SPEC, attention, bad_inputs, problem_of  # noqa: F401
from tritune.kernels.attention.launch import GLUON_SCHEDULES, LOG2E  # noqa: F401
from tritune.kernels.attention.problem import (DTYPES, HEAD_DIMS, PackedProblem, Problem,  # noqa: F401
                                               VarlenProblem, bucket, cost, cu_seqlens, make_inputs,
                                               make_varlen_inputs, problems, varlen_problems)
from tritune.kernels.attention.space import (PERSISTENT_SCHEDULES, SCHEDULES, SPACE, capability,  # noqa: F401
                                             default_config, gluon_config, gluon_seeds, smem_bytes, smem_limit,
                                             varlen_default_config)
from tritune.kernels.attention.varlen import (CHECKED, VARLEN_PLANS, VARLEN_SPEC, attention_varlen,  # noqa: F401
                                              longest_cached, varlen_problem_of)

# the names these had when attention was one module (the tests of other kernels read them)
_PLANS = PLANS
_VARLEN_PLANS = VARLEN_PLANS
_CHECKED = CHECKED
_longest_cached = longest_cached
