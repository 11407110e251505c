"""tritune.patch on a Hugging Face GPT2LMHeadModel: logits and generate (DynamicCache, StaticCache, a
left-padded batch) against the unpatched model run in float64, refusals by option name, and
torch.compile(fullgraph=True) of the patched model with no recompilation across sequence lengths.

CPU: a tiny random GPT-2 written with save_pretrained and read back with from_pretrained, fp32.
GPU: the GPT-2 small config, random init, bf16.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import re
import shutil
import signal
import sys
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.kernels.runtime import compare as cmp  # noqa: E402
from tritune.kernels.runtime import device as dev  # noqa: E402
from tritune.model import patch as hf_patch  # noqa: E402

DEVICE = dev.device()
TINY = dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**TINY)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # biases and LayerNorm affine are zeros/ones at init: make them count
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("tiny_gpt2")
    model.save_pretrained(path)
    return path


def _load(path, dtype=torch.float32, **kw):
    m = transformers.GPT2LMHeadModel.from_pretrained(path, dtype=dtype, **kw).to(DEVICE).eval()
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """(patched fp32 model, unpatched float64 reference)."""
    return hf_patch.patch(_load(tiny_dir)), _load(tiny_dir, torch.float64)


def _ids(b, t, seed, vocab=TINY["vocab_size"]):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (b, t), generator=g).to(DEVICE)


@torch.no_grad()
def test_logits_match_unpatched(pair):
    model, ref = pair
    ids = _ids(2, 11, 0)
    cmp.check(model(ids).logits, ref(ids).logits, torch.float32, what="prefill logits")


def test_patch_swaps_modules_in_place(tiny_dir):
    m = _load(tiny_dir)
    assert hf_patch.patch(m) is m and hf_patch.patch(m) is m  # idempotent
    assert m.transformer.h[0].forward.__func__ is hf_patch._block_forward
    assert m.transformer.ln_f.forward.__func__ is hf_patch._ln_final_forward
    assert m.lm_head.forward.__func__ is hf_patch._head_forward
    assert m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr()  # ties kept, nothing copied


def _generate(model, ids, **kw):
    out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_generate_matches_unpatched(pair, cache):
    """Prefill and four decode steps: the static cache's steps go through paged_attention over a
    block table of the valid keys; the dynamic cache's through causal attention."""
    model, ref = pair
    ids = _ids(3, 6, 1)
    # transformers torch.compiles a static cache's decode on a GPU by itself (65-75 s of inductor per model
    # under 16 test workers); the compiled patched model has its own test (compiled_forward_static_cache)
    kw = {} if cache == "dynamic" else {"cache_implementation": "static", "disable_compile": True}
    seq, logits = _generate(model, ids, **kw)
    want_seq, want = _generate(ref, ids, **kw)
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what=f"generate logits ({cache} cache)")


@torch.no_grad()
def test_generate_left_padded_batch(pair):
    """A padding mask: the prefill takes the model's sdpa, each decode step paged attention over the
    keys the mask leaves (holes at the start of the shorter row)."""
    model, ref = pair
    ids = _ids(2, 7, 2)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    seq, logits = _generate(model, ids, attention_mask=mask)
    want_seq, want = _generate(ref, ids, attention_mask=mask)
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what="padded generate logits")


class _Refuse:
    """Stands for a namespace of ops that must not be called."""

    def __init__(self, what):
        self.what = what

    def __getattr__(self, name):
        raise AssertionError(f"{self.what}.{name} called")


def test_eager_inference_skips_the_dispatcher_and_grad_takes_the_ops(pair, monkeypatch):
    """no_grad eager calls go to the ops' bodies (no dispatcher); with autograd on, the ops."""
    model, ref = pair
    ids = _ids(2, 5, 7)
    want = ref(ids).logits.detach()
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(hf_patch, "OPS", _Refuse("torch.ops.tritune"))
        cmp.check(model(ids).logits, want, torch.float32, what="eager, no grad")
    with monkeypatch.context() as m:
        m.setattr(hf_patch, "EAGER", _Refuse("torch_ops.EAGER"))
        cmp.check(model(ids).logits.detach(), want, torch.float32, what="grad enabled")


@torch.no_grad()
def test_decode_tables_made_once_a_step(pair, monkeypatch):
    """Eager static-cache decode: the block table of the valid keys is made once a step and shared by
    every layer (the same mask object), not once a layer; the tokens stay the reference's."""
    model, ref = pair
    made = []
    tables = hf_patch._tables
    monkeypatch.setattr(hf_patch, "_tables", lambda *a: made.append(1) or tables(*a))
    kw = {"cache_implementation": "static", "disable_compile": True}
    ids = _ids(2, 6, 8)
    seq, logits = _generate(model, ids, **kw)
    want_seq, want = _generate(ref, ids, **kw)
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what="static-cache generate logits")
    assert len(made) == 4, f"{len(made)} tables for 4 decode steps of {model.config.n_layer} layers"


@torch.no_grad()
def test_compiled_decode_makes_the_tables_once(tiny_dir, pair):
    """Under torch.compile the step memo is traced: the decode graph builds the table (a running count
    of the mask) once, not once a layer (inductor merges no identical work across layers), with no graph break, and the second
    generate reuses the graphs (the memo is empty at every call's start: no recompile)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, ref = pair
    model = hf_patch.patch(_load(tiny_dir))
    model.generation_config.disable_compile = True
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=capture, fullgraph=True)
    kw = {"cache_implementation": "static"}
    seq, _ = _generate(model, _ids(2, 6, 9), **kw)
    want, _ = _generate(ref, _ids(2, 6, 9), **kw)
    assert torch.equal(seq, want)
    n = len(graphs)
    scans = [sum(node.target in ("cumsum", torch.cumsum, torch.Tensor.cumsum) for node in g.graph.nodes)
             for g in graphs]
    assert max(scans) == 1, f"table scans per graph: {scans} ({model.config.n_layer} layers)"
    _generate(model, _ids(2, 6, 10), **kw)
    assert len(graphs) == n, "recompiled"


@pytest.mark.parametrize("option,value", [("scale_attn_by_inverse_layer_idx", True),
                                          ("reorder_and_upcast_attn", True),
                                          ("add_cross_attention", True),
                                          ("activation_function", "relu")])
def test_unsupported_options_refused_by_name(option, value):
    cfg = transformers.GPT2Config(**TINY, **{option: value})
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match=option):
        hf_patch.patch(model)


def test_bad_model_type():
    with pytest.raises(TypeError, match="model"):
        hf_patch.patch(torch.nn.Linear(2, 2))


@torch.no_grad()
def test_compile_fullgraph_no_recompile(pair):
    from torch._dynamo.testing import CompileCounterWithBackend

    model, ref = pair
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for i, t in enumerate((4, 9, 15)):
        ids = _ids(2, t, t)
        cmp.check(compiled(ids, use_cache=False).logits, ref(ids).logits, torch.float32, what=f"compiled T={t}")
        if i == 0:  # dynamo may restart its analysis of the first call (counted as a frame): no more after it
            first = counter.frame_count
    assert counter.frame_count == first, f"recompiled: {counter.frame_count - first} more graphs after T=4"


@torch.no_grad()
def test_compiled_causal_forward_takes_tritune_attention(pair, monkeypatch):
    """No attention_mask and no static cache: plainly causal. Eager transformers drops the mask itself;
    compiled it materialises a dense (B, 1, T, T) one, which the layers must not hand to sdpa: the
    compiled graph calls tritune.attention in every layer and sdpa never (aot_eager backend, its graph
    read off). The same holds for a chunk over a DynamicCache with a past (bottom-right causal): logits
    equal to the float64 unpatched model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, ref = pair
    L = model.config.n_layer
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    ids = _ids(2, 9, 5)
    cmp.check(compiled(ids, use_cache=False).logits, ref(ids).logits, torch.float32, what="compiled causal forward")
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("tritune.attention" in t for t in targets) == L, targets
    assert not [t for t in targets if "scaled_dot_product" in t], "sdpa in the compiled causal forward"

    # eager, a 5-token chunk after a 7-token past in a DynamicCache, no mask: the layers' attention is ours
    calls = []
    real = hf_patch.EAGER.attention
    monkeypatch.setattr(hf_patch.EAGER, "attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    full = _ids(2, 12, 6)
    past = model(full[:, :7], use_cache=True).past_key_values
    got = model(full[:, 7:], past_key_values=past, use_cache=True).logits
    want = ref(full).logits[:, 7:]
    cmp.check(got, want, torch.float32, what="chunk over a DynamicCache, no mask")
    assert len(calls) == 2 * L and all(c[2] == 5 for c in calls[L:]), calls


@torch.no_grad()
def test_compiled_forward_static_cache_generate(tiny_dir, pair):
    """HF's static-cache recipe (the forward under torch.compile, fullgraph): the prefill (sdpa: the
    mask is materialized while tracing) and the decode steps (paged_attention over the mask's keys)
    compile once each and match the float64 model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _, ref = pair
    model = hf_patch.patch(_load(tiny_dir))
    model.generation_config.disable_compile = True
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model.forward = torch.compile(model.forward, backend=counter, fullgraph=True)
    kw = {"cache_implementation": "static"}
    seq, logits = _generate(model, _ids(2, 6, 5), **kw)
    want_seq, want = _generate(ref, _ids(2, 6, 5), **kw)
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what="compiled static-cache generate logits")
    first = counter.frame_count
    _generate(model, _ids(2, 6, 6), **kw)
    assert counter.frame_count == first


class _FormatRecords(logging.Handler):
    def emit(self, record):
        record.getMessage()  # what emitting costs: the message built from its arguments


@contextlib.contextmanager
def _fallback_log_built():
    """Inductor's "Creating implicit fallback for: <op>(<args' IR>)" INFO text built at every implicit
    fallback, as torch <= 2.11 builds it whatever the log level (from 2.12 on, only when emitted)."""
    log = logging.getLogger("torch._inductor.graph")
    handler, level, propagate = _FormatRecords(logging.INFO), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


@contextlib.contextmanager
def _within(seconds):
    """A time limit in the main thread (a compile that would run for hours fails instead)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise TimeoutError(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


DEEP_LAYERS, DEEP_HANG_S = 6, 900


@pytest.mark.skipif(DEVICE == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
@torch.no_grad()
def test_deep_patched_model_compiles():
    """Inductor compiles the forward of a 6-layer patched model (~7 s on the CPU; the time is printed, not
    asserted: CPUs differ) with the implicit-fallback log text built as torch <= 2.11 builds it. Before the
    ops were explicit fallbacks that text printed each op's argument IR recursively, doubling with every
    residual op: 3 layers took 21 s, 4 over 100 s (docs/findings.md), GPT-2 small on the H100 over 420 s;
    a guard of DEEP_HANG_S fails such a compile instead of hanging the suite. Output equals eager."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**TINY, "n_layer": DEEP_LAYERS}))
    model = hf_patch.patch(model.to(DEVICE).eval())
    ids = _ids(2, 8, 9)
    want = model(ids, use_cache=False).logits
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: model(x, use_cache=False).logits, backend="inductor", fullgraph=True)
    with _fallback_log_built(), torch._inductor.config.patch(fx_graph_cache=False), _within(DEEP_HANG_S):
        t0 = time.perf_counter()
        got = compiled(ids)
        print(f"inductor compile of the {DEEP_LAYERS}-layer patched forward: {time.perf_counter() - t0:.1f} s")
    cmp.check(got, want, torch.float32, what=f"inductor-compiled {DEEP_LAYERS}-layer patched forward")


# ---------------------------------------------------------------------------------------------------
def _small(dtype):
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config()).to(DEVICE, dtype).eval()
    m.generation_config.pad_token_id = 0
    return m


def _model_bound(theirs, truth):
    """(bound, transformers' error) for a whole model's logits against float64 ``truth``, given
    transformers' own logits at the same precision on the same input: the project's model-level rule
    (tests/test_model.py, ``bound``), max(the table's tolerance, 2 x transformers' error)."""
    hf_err = cmp.rel_error(theirs, truth)
    return max(cmp.tolerance(theirs.dtype), 2 * hf_err), hf_err


@pytest.mark.gpu
@torch.no_grad()
def test_gpt2_small_bf16_logits_gpu(monkeypatch):
    """Whole-model bf16 logits against float64. Twelve layers that each store their activations in bf16
    are no single kernel: the logits' error is set by the data type, and transformers' own bf16 model
    shows its size on the same input (1.2e-2 for GPT-2 small at random init, 2 x 64 tokens, over the
    bf16 table's 1e-2; the patched model measured 1.03e-2 here). So the bound is relative to it, as for
    tritune's own model (tests/test_model.py); each kernel is held to the table alone in its own tests.
    A real bug is an error of order 1 and fails by far: the MLP's GELU dropped (0.95 measured in
    float64), one block's MLP lost (0.36). The first is checked at the end."""
    ref = _small(torch.float64)
    hf16 = copy.deepcopy(ref).to(torch.bfloat16)
    model = hf_patch.patch(copy.deepcopy(hf16))
    ids = _ids(4, 256, 0, 50257)
    truth = ref(ids).logits
    bound, hf_err = _model_bound(hf16(ids).logits, truth)
    err = cmp.rel_error(model(ids).logits, truth)
    assert err <= bound, f"bf16 prefill logits: rel error {err:.3e} (bound {bound:.1e}; transformers bf16 {hf_err:.3e})"

    # disable_compile: not transformers' own inductor compile of GPT-2 small (test_gpt2_small_compiled_gpu)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True,
              cache_implementation="static", disable_compile=True)
    out = model.generate(ids[:, :32], **kw)
    want = ref(out.sequences).logits[:, 31:-1]
    bound, hf_err = _model_bound(hf16(out.sequences).logits[:, 31:-1], want)
    err = cmp.rel_error(torch.stack(out.logits, 1), want)
    assert err <= bound, (f"bf16 static-cache generate logits: rel error {err:.3e} (bound {bound:.1e}; "
                          f"transformers bf16 {hf_err:.3e})")

    # the bound still sees a real bug: the MLP's GELU dropped
    ln_linear = hf_patch._ln_linear
    monkeypatch.setattr(hf_patch, "_ln_linear", lambda x, ln, conv, activation=None: ln_linear(x, ln, conv))
    broken = cmp.rel_error(model(ids).logits, truth)
    assert broken > 10 * bound, f"GELU dropped: rel error {broken:.3e}, not past the bound {bound:.1e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@torch.no_grad()
def test_gpt2_small_compiled_gpu(mode):
    """The compiled patched model's bf16 logits, held to the model-level rule (``_model_bound``: the table's
    tolerance or 2 x transformers' own bf16 error on the same input) like the eager test above: twelve
    bf16 layers set the error, not one kernel (the H200 measured 1.026e-2 at T=17 against the table's 1e-2)."""
    ref = _small(torch.float64)
    hf16 = copy.deepcopy(ref).to(torch.bfloat16)
    model = hf_patch.patch(copy.deepcopy(hf16))
    compiled = torch.compile(model, fullgraph=True, dynamic=True, mode=mode)
    for t in (17, 128, 300):
        ids = _ids(2, t, t, 50257)
        for _ in range(2 if mode else 1):  # reduce-overhead records on the second call
            got = compiled(ids, use_cache=False).logits
        truth = ref(ids).logits
        bound, hf_err = _model_bound(hf16(ids, use_cache=False).logits, truth)
        err = cmp.rel_error(got, truth)
        assert err <= bound, (f"compiled {mode} T={t}: rel error {err:.3e} (bound {bound:.1e}; "
                              f"transformers bf16 {hf_err:.3e})")


@pytest.mark.parametrize("per_row", [0, 7, 32])
def test_tables_list_the_valid_keys_in_order(per_row):
    """The decode block table: each row's valid keys (holes anywhere: left padding, unwritten slots), in
    order, offset by the row's first block; the length is their count."""
    g = torch.Generator().manual_seed(per_row)
    B, Tk = (1 if per_row == 0 else 5), 13
    valid = torch.rand(B, Tk, generator=g) < 0.6
    valid[:, 0] = True  # every row attends to at least one key
    tables, lens = hf_patch._tables(valid, B, per_row, valid.device)
    assert tables.dtype == lens.dtype == torch.int32 and tables.shape == (B, Tk)
    for b in range(B):
        want = torch.nonzero(valid[b]).flatten().to(torch.int32) + b * per_row
        assert int(lens[b]) == want.numel()
        assert torch.equal(tables[b, :want.numel()], want)


def _call_body(code: str) -> list:
    """The lines of inductor's generated ``call`` (the per-step host program: kernels, fallbacks, allocations)."""
    lines = code.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("def call(self, args)"))
    body = []
    for ln in lines[start + 1:]:
        if ln.strip().startswith("return "):
            break
        body.append(ln.strip())
    return body


@pytest.mark.skipif(DEVICE != "cpu" or (shutil.which("g++") is None and shutil.which("c++") is None),
                    reason="counts inductor's C++ (CPU) wrapper; needs a C++ compiler")
@torch.no_grad()
def test_compiled_decode_step_does_only_the_step(tiny_dir):
    """transformers' static-cache compile recipe through inductor: the decode step's generated program is
    the step and nothing more. Per layer 4 ``linear`` ops and one ``paged_attention`` reading HF's cache in
    place (a view, never a copy), plus ``layer_norm`` and the head once; at most one aten fallback (the
    table's scan on the CPU backend); no buffer as large as a layer's cache (no per-step materialised cache
    or mask over it); the mask consumed in place."""
    from transformers import CompileConfig
    from torch._inductor.utils import run_and_get_code

    model = hf_patch.patch(_load(tiny_dir))
    cc = CompileConfig(fullgraph=True, backend="inductor", mode=None)
    cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
    model.generation_config.compile_config = cc
    B, T, new = 3, 6, 3
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(lambda: model.generate(_ids(B, T, 11), max_new_tokens=new, min_new_tokens=new,
                                                           do_sample=False, cache_implementation="static"))
    steps = [c for c in codes if "tritune.paged_attention" in c]
    assert len(steps) == 1, f"{len(steps)} decode programs"
    body = _call_body(steps[0])
    L, C, H = model.config.n_layer, model.config.n_embd, model.config.n_head
    calls = [ln for ln in body if "torch.ops." in ln and "=" in ln and not ln.startswith("#")]
    ours = [ln for ln in calls if "torch.ops.tritune." in ln]
    assert sum("tritune.linear." in ln for ln in ours) == 4 * L + 1, ours
    assert sum("tritune.paged_attention." in ln for ln in ours) == L, ours
    assert sum("tritune.layer_norm." in ln for ln in ours) == 1, ours
    assert len(ours) == 5 * L + 2, ours
    aten = [ln for ln in calls if "torch.ops.aten." in ln]
    assert len(aten) <= 1, f"aten fallbacks in the step: {aten}"
    assert not [ln for ln in body if "aten.copy_" in ln or ".clone(" in ln], "copies in the step"
    cache_numel = B * H * (T + new) * (C // H)  # one layer's K cache: B x H x max_cache_len x D
    for ln in body:
        if "empty_strided" in ln:
            shape = ln.split("((", 1)[1].split(")", 1)[0]
            numel = 1
            for d in filter(None, (x.strip() for x in shape.split(","))):
                numel *= int(d)
            assert numel < cache_numel, f"a cache-sized buffer in the step: {ln}"


@pytest.mark.skipif(DEVICE != "cpu" or (shutil.which("g++") is None and shutil.which("c++") is None),
                    reason="counts inductor's C++ (CPU) wrapper; needs a C++ compiler")
@torch.no_grad()
def test_compiled_prefill_launches_what_eager_launches(pair):
    """torch.compile (inductor, default mode) of a patched causal prefill without a cache generates the
    eager path's program and no more: per layer 4 ``linear`` ops and one causal ``attention`` whose q, k, v
    are views of the qkv ``linear``'s output (reinterpret_tensor, never a copy), one elementwise kernel a
    layer (the heads' transpose to (B, T, C): eager's reshape copy) and one for the embeddings; ln_f's
    ``layer_norm`` and the head's ``linear`` once; no aten fallback (mm, sdpa, copy_, clone) and no buffer
    of a (T, T) mask. So what the compiled prefill adds over eager on the GPU is host work per op, not
    device work: each ``torch.ops.tritune`` call in the generated program goes through the dispatcher
    (custom_op's Python autograd and backend layers, ~12 us an op on this CPU) where eager calls the
    op's body (``torch_ops.EAGER``); benchmarks/bench_hf_patch.py --part prefill measures both on the GPU."""
    from torch._inductor.utils import run_and_get_code

    model, ref = pair
    L = model.config.n_layer
    B, T = 2, 24
    ids = _ids(B, T, 21)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: model(x, use_cache=False).logits, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, codes = run_and_get_code(compiled, ids)
    cmp.check(got, ref(ids).logits, torch.float32, what="compiled prefill")
    assert len(codes) == 1, f"{len(codes)} programs"
    body = _call_body(codes[0])
    calls = [ln for ln in body if "(" in ln and not ln.startswith(("#", "assert_", "del "))]
    ours = [ln for ln in calls if "torch.ops.tritune." in ln]
    assert sum("tritune.linear." in ln for ln in ours) == 4 * L + 1, ours
    attn = [ln for ln in ours if "tritune.attention." in ln]
    assert len(attn) == L and len(ours) == 5 * L + 2, ours
    assert sum("tritune.layer_norm." in ln for ln in ours) == 1, ours
    alias = dict(ln.split(" = ") for ln in body if re.fullmatch(r"buf\d+ = buf\d+", ln))  # the op's result renamed
    for i, ln in enumerate(ours):  # each attention's q, k, v: three views of the linear just before it
        if "tritune.attention." in ln:
            views = set(re.findall(r"reinterpret_tensor\((buf\d+),", ln))
            qkv = ours[i - 1].split(" = ", 1)[0]
            assert "tritune.linear." in ours[i - 1] and {alias.get(b, b) for b in views} == {qkv}, (ours[i - 1], ln)
            assert len(re.findall(r"reinterpret_tensor\(buf", ln)) == 3, ln
            assert ", True," in ln, f"not causal: {ln}"
    kernels = [ln for ln in calls if ln.startswith("cpp_fused")]
    assert len(kernels) == L + 1, kernels
    aten = [ln for ln in calls if "torch.ops.aten." in ln or "extern_kernels." in ln]
    assert not aten, f"aten fallbacks in the compiled prefill: {aten}"
    assert not [ln for ln in body if ".copy_(" in ln or ".clone(" in ln], "copies in the compiled prefill"
    for ln in body:
        if "empty_strided" in ln:
            shape = ln.split("((", 1)[1].split(")", 1)[0]
            dims = [int(d) for d in (x.strip() for x in shape.split(",")) if d]
            assert dims[-2:] != [T, T], f"a (T, T) mask buffer: {ln}"


def _decode_step_graph(model) -> tuple:
    """transformers' static-cache compile recipe with a backend that records the decode graph dynamo hands
    over: (its inputs, static inputs (parameters, buffers, addresses marked static: CUDA-graph trees check
    these by pointer, and copy every other input into the graph's buffers on each replay), outputs, the
    guard-tree lines of the compiled frame (what dynamo checks before each call))."""
    from transformers import CompileConfig
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    seen = []

    def record(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        static = sum(isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) is not None
                     for x in tensors)
        seen.append((sum(n.op == "placeholder" for n in gm.graph.nodes), static, len(out)))
        return gm.forward

    cc = CompileConfig(fullgraph=True, mode=None)
    cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
    model.generation_config.compile_config = cc
    model.generation_config.disable_compile = False
    model._last_compile_config = cc  # generate takes this compiled call for its decode steps
    model._compiled_call = torch.compile(model.__call__, backend=record, fullgraph=True)
    torch._dynamo.reset()
    model.generate(_ids(2, 5, 12), max_new_tokens=3, min_new_tokens=3, do_sample=False, cache_implementation="static")
    assert len(seen) == 1, f"{len(seen)} decode graphs"
    lines, fn = 0, type(model).forward
    while fn is not None:  # the frame dynamo compiled: the forward or one of transformers' wrappers around it
        for entry in _debug_get_cache_entry_list(fn.__code__):
            lines += sum(1 for ln in str(entry.guard_manager).splitlines() if ln.strip())
        fn = getattr(fn, "__wrapped__", None)
    return (*seen[0], lines)


@torch.no_grad()
def test_compiled_decode_step_takes_no_more_host_work_than_unpatched(tiny_dir, tmp_path):
    """What a compiled (CUDA-graph) decode step costs the host outside its kernels scales with the graph's
    inputs (each checked or copied every replay), outputs and dynamo's guards. The patched step's are the
    unpatched step's or fewer: its weights are the modules' own parameters (no tensor attribute lifted as
    a non-static input), nothing extra comes out of the graph, and its guards grow more slowly with depth
    (none per layer on the patch's state; transformers' own guard each layer's config). A few guards are
    the patch's own, once (its module's globals): 2 layers can show them (transformers 5.17: 1050 patched
    against 1044), so the guards are compared at 4 layers and per layer between 2 and 4.
    Measured on the CPU (benchmarks/bench_hf_patch.py --part step --smoke --smoke-backend inductor
    --stub-kernels, 12 layers): 187 inputs (184 static) and 1 output both; guard-tree lines 2958 patched vs 3599."""
    torch.manual_seed(0)
    deeper = tmp_path / "tiny_gpt2_4"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**TINY, "n_layer": 4})).save_pretrained(deeper)
    names = ("inputs", "static inputs", "outputs", "guard-tree lines")
    runs = {}
    for layers, path in ((2, tiny_dir), (4, deeper)):
        hf = dict(zip(names, _decode_step_graph(_load(path))))
        ours = dict(zip(names, _decode_step_graph(hf_patch.patch(_load(path)))))
        assert ours["inputs"] <= hf["inputs"] and ours["outputs"] <= hf["outputs"], (layers, ours, hf)
        assert ours["inputs"] - ours["static inputs"] <= hf["inputs"] - hf["static inputs"], (layers, ours, hf)
        runs[layers] = (ours["guard-tree lines"], hf["guard-tree lines"])
    assert runs[4][0] <= runs[4][1], runs
    assert runs[4][0] - runs[2][0] <= runs[4][1] - runs[2][1], runs  # guard lines per layer


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values back to the host (each a sync on a GPU): ``item()``,
    ``tolist()``, ``.cpu()``, ``bool()`` / ``int()`` of a tensor, ops whose output size depends on values.
    Calls made by the Triton interpreter (how kernels run on the CPU) are not the launchers' and not counted."""

    NAMES = frozenset(("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                       "nonzero", "masked_select", "unique"))

    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES and not sys._getframe(1).f_globals.get("__name__", "").startswith("triton"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _NoProfile:
    def enable(self):
        pass

    disable = enable


def _generate_loop_counts(model, B=2, T=4, new=3) -> dict:
    """transformers' static-cache compile recipe (dynamo's eager backend: what runs outside the compiled call
    does not depend on the backend), after a warm-up generate, one generate counted: the Python calls of
    generate's own loop (cProfile, off in the prefill and in the compiled calls), the host reads of the
    prefill and of the loop (off in the compiled calls), the compiled calls against the decode steps,
    dynamo's counters, and the logits the prefill and a decode step return (shape, dtype)."""
    import cProfile
    import pstats

    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
    model.generation_config.compile_config = cc
    model.generation_config.disable_compile = False
    compiled = model.get_compiled_call(cc)
    prefill_of, forward = model._prefill, model.forward
    prof = cProfile.Profile()
    seen = {"calls": 0, "logits": set(), "counting": False}
    reads = {"prefill": {}, "loop": {}}
    mode = [None]

    def spy(*a, **k):
        out = forward(*a, **k)
        seen["logits"].add((tuple(out.logits.shape), out.logits.dtype))
        return out

    def prefill(*a, **k):
        if not seen["counting"]:
            return prefill_of(*a, **k)
        prof.disable()
        if mode[0] is not None:
            mode[0].__exit__(None, None, None)
        model.forward = spy
        try:
            with _HostReads(reads["prefill"]):
                return prefill_of(*a, **k)
        finally:
            del model.forward
            if mode[0] is not None:
                mode[0] = _HostReads(reads["loop"])
                mode[0].__enter__()
            prof.enable()

    def call(*a, **k):
        if not seen["counting"]:
            return compiled(*a, **k)
        prof.disable()
        if mode[0] is not None:
            mode[0].__exit__(None, None, None)
        try:
            out = compiled(*a, **k)
            seen["logits"].add((tuple(out.logits.shape), out.logits.dtype))
            return out
        finally:
            seen["calls"] += 1
            if mode[0] is not None:
                mode[0] = _HostReads(reads["loop"])
                mode[0].__enter__()
            prof.enable()

    model._compiled_call, model._prefill = call, prefill
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    ids = _ids(B, T, 13)
    model.generate(ids, **kw)  # compiles
    before = {cat: dict(c) for cat, c in torch._dynamo.utils.counters.items()}
    seen["counting"] = True
    prof.enable()  # the Python calls in one generate, the host reads in another (the mode's are Python calls)
    model.generate(ids, **kw)
    prof.disable()
    calls = sum(nc for (_, nc, _, _, _) in pstats.Stats(prof).stats.values())
    prof = _NoProfile()
    compiled_calls, seen["calls"] = seen["calls"], 0
    mode[0] = _HostReads(reads["loop"])
    mode[0].__enter__()
    try:
        model.generate(ids, **kw)
    finally:
        mode[0].__exit__(None, None, None)
    after = {cat: {k: v - before.get(cat, {}).get(k, 0) for k, v in c.items()}
             for cat, c in torch._dynamo.utils.counters.items()}
    return {"steps": new - 1, "compiled_calls": (compiled_calls, seen["calls"]), "logits": seen["logits"],
            "python_calls": calls, "host_reads": reads,
            "dynamo": {cat: {k: v for k, v in c.items() if v} for cat, c in after.items() if any(c.values())}}


@torch.no_grad()
def test_compiled_generate_loop_does_no_more_than_unpatched(tiny_dir):
    """A compiled static-cache generate of the patched model runs the same loop as HF's: every decode step
    one compiled call, no recompile or new frame once warm, no more Python calls outside the prefill and the
    compiled call, no more host reads of tensor values (item, bool, nonzero...: a sync each on a GPU) in
    the prefill (ours runs eagerly on the kernels) or in the loop, the prefill's logits only the last
    position's (logits_to_keep) in the model's dtype. (On the H100 the patched generate was ~0.8 ms a step
    slower while its compiled call was not: benchmarks/bench_hf_patch.py --part genprof splits a generate there.)
    Measured on the CPU (transformers 5.24): the same Python calls outside the compiled call, and 2 host reads
    a step (the stop check), both."""
    hf = _generate_loop_counts(_load(tiny_dir))
    ours = _generate_loop_counts(hf_patch.patch(_load(tiny_dir)))
    V = TINY["vocab_size"]
    for got in (hf, ours):
        assert got["compiled_calls"] == (got["steps"], got["steps"]), got
        assert got["dynamo"] == {}, got["dynamo"]  # no recompile, no frame compiled, no graph break
        assert got["logits"] == {((2, 1, V), torch.float32)}, got["logits"]
    assert ours["python_calls"] <= hf["python_calls"], (ours["python_calls"], hf["python_calls"])
    for phase in ("prefill", "loop"):
        got, want = ours["host_reads"][phase], hf["host_reads"][phase]
        assert all(n <= want.get(op, 0) for op, n in got.items()), (phase, got, want)


def _steady_generate_gpu(model, B=4, T=8, new=16) -> dict:
    """transformers' recipe (CompileConfig reduce-overhead: CUDA graphs) on a GPU: two generates, then a third
    counted: CUDA-graph trees' records and eager warm-ups (a new static-cache address re-records), the
    syncs (sync debug mode: one warning per synchronizing call), the compiled calls."""
    import warnings

    from torch._inductor import cudagraph_trees as ct
    from transformers import CompileConfig

    model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    model.generation_config.disable_compile = False
    compiled = model.get_compiled_call(model.generation_config.compile_config)
    seen = {"calls": 0}

    def call(*a, **k):
        seen["calls"] += 1
        return compiled(*a, **k)

    model._compiled_call = call
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    ids = _ids(B, T, 21)
    torch._dynamo.reset()
    for _ in range(2):
        model.generate(ids, **kw)
    counts = {"record_function": 0, "run_eager": 0}
    saved = {name: getattr(ct.CUDAGraphTreeManager, name) for name in counts}

    def counting(name):
        def run(*a, **k):
            counts[name] += 1
            return saved[name](*a, **k)
        return run

    seen["calls"] = 0
    try:
        for name in counts:
            setattr(ct.CUDAGraphTreeManager, name, counting(name))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model.generate(ids, **kw)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        for name, fn in saved.items():
            setattr(ct.CUDAGraphTreeManager, name, fn)
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    return {"steps": new - 1, "compiled_calls": seen["calls"], "syncs": syncs, **counts}


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_generate_steady_state_gpu(tiny_dir):
    """A third compiled (CUDA-graph) static-cache generate of the patched model replays what the first two
    recorded, as HF's does: no more graph records or eager warm-ups than HF's (a static input at a new
    address re-records), no more syncs, one compiled call a decode step."""
    hf = _steady_generate_gpu(_load(tiny_dir))
    ours = _steady_generate_gpu(hf_patch.patch(_load(tiny_dir), cuda_graphs=False))  # CUDA-graph trees, as HF's
    for got in (hf, ours):
        assert got["compiled_calls"] == got["steps"], got
    assert ours["record_function"] <= hf["record_function"], (ours, hf)
    assert ours["run_eager"] <= hf["run_eager"], (ours, hf)
    assert ours["syncs"] <= hf["syncs"], (ours, hf)


# --- the decode step as one CUDA graph a key (ThinGraphCall) -----------------------------------------
def _drop_last_token(cache) -> None:
    """A static cache's last token forgotten: its crop(-1) where transformers has one (5.2x), else each
    layer's fill count one less (5.17's StaticLayer has no crop)."""
    if hasattr(cache.layers[0], "crop"):
        cache.crop(-1)
        return
    for lay in cache.layers:
        lay.cumulative_length -= 1


def _cache_name(kw) -> str:
    """The cache's keyword in a decode step's call: "cache" (transformers >= 5.2x) or "past_key_values"."""
    return "cache" if "cache" in kw else "past_key_values"


class _FakeGraph:
    """A CUDA graph's contract on the CPU: capturing runs no kernel (the cache is put back as it was),
    a replay recomputes from the static inputs into the same output tensors."""

    def __init__(self, fn, static):
        self.fn, self.static = fn, static
        cache = static[_cache_name(static)]
        saved = [(lay.keys.clone(), lay.values.clone(), lay.cumulative_length.clone()) for lay in cache.layers]
        self.out = fn(**static)
        for lay, (k, v, n) in zip(cache.layers, saved):
            lay.keys.copy_(k), lay.values.copy_(v), lay.cumulative_length.copy_(n)

    def replay(self):
        new = self.fn(**self.static)
        for field, t in self.out.items():
            if isinstance(t, torch.Tensor):
                t.copy_(new[field])


@pytest.fixture
def fake_graphs(monkeypatch):
    """ThinGraphCall with the capture stubbed (CPU tensors allowed); returns the list of graphs made."""
    made = []

    def record(self, static):
        made.append(_FakeGraph(self.compiled, static))
        return made[-1], made[-1].out

    monkeypatch.setattr(hf_patch.ThinGraphCall, "_record", record)
    monkeypatch.setattr(hf_patch.ThinGraphCall, "require_cuda", False)
    return made


def _thin_model(tiny_dir, **kw):
    m = hf_patch.patch(_load(tiny_dir), **{"cuda_graphs": True, **kw})
    cc = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
    m.generation_config.compile_config = cc
    return m


@torch.no_grad()
def test_thin_graph_generate_matches_eager(tiny_dir, fake_graphs):
    """generate's decode steps through ThinGraphCall (capture stubbed): the same tokens and logits as the
    patched model eager, one warm-up and one capture per (batch, cache) key, every later step a replay."""
    model = _thin_model(tiny_dir)
    new, runs = 5, ((2, 6, 1), (3, 4, 2), (2, 6, 3))  # _generate: 5 new tokens
    for b, t, seed in runs:
        ids = _ids(b, t, seed)
        model.generation_config.disable_compile = True
        want_seq, want = _generate(model, ids, cache_implementation="static")
        model.generation_config.disable_compile = False
        seq, logits = _generate(model, ids, cache_implementation="static")
        assert torch.equal(seq, want_seq), (b, t)
        cmp.check(logits, want, torch.float32, what=f"thin-graph generate b={b} t={t}")
    call = model._compiled_call
    assert isinstance(call, hf_patch.ThinGraphCall)
    steps = new - 1  # decode calls a generate (the prefill is eager)
    assert call.stats == {"warmups": 3, "captures": 3, "replays": 3 * (steps - 1)}, call.stats
    assert len(fake_graphs) == 3


@torch.no_grad()
def test_thin_graph_decode_mask_left_padded(tiny_dir, fake_graphs):
    """A compiled generate's decode steps take the 2-D padding mask padded to the cache's length (one fixed
    shape; the forward builds the 4-D mask inside the graph): rows left-padded by different amounts give the
    tokens and logits of the eager generate, whose steps take transformers' own 4-D mask. The prefill and
    the eager generate keep transformers' mask; turning cuda_graphs off gives transformers' mask back."""
    model = _thin_model(tiny_dir)
    ids = _ids(3, 7, 11)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    calls = model.create_masks_for_generate.calls
    model.generation_config.disable_compile = True
    want_seq, want = _generate(model, ids, attention_mask=mask, cache_implementation="static")
    assert calls == {"transformers": 5}, calls  # prefill + 4 steps
    model.generation_config.disable_compile = False
    seq, logits = _generate(model, ids, attention_mask=mask, cache_implementation="static")
    assert calls == {"transformers": 6, "padded": 4}, calls
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what="thin-graph generate, left-padded rows")
    call = model._compiled_call
    assert call.stats == {"warmups": 1, "captures": 1, "replays": 3}, call.stats  # one key: a fixed mask shape
    hf_patch.patch(model, cuda_graphs=False)
    assert "create_masks_for_generate" not in model.__dict__ and "_valid_auto_compile_criteria" not in model.__dict__


def _thin_generate_calls(model, ids):
    """generate (5 new tokens, static cache) through the thin call; the kwargs of each decode call."""
    seen, real = [], hf_patch.ThinGraphCall.__call__

    def spy(self, *a, **k):
        seen.append(dict(k))
        return real(self, *a, **k)

    hf_patch.ThinGraphCall.__call__ = spy
    try:
        out = _generate(model, ids, cache_implementation="static")
    finally:
        hf_patch.ThinGraphCall.__call__ = real
    return out, seen


@torch.no_grad()
def test_thin_graph_key_and_fallbacks(tiny_dir, fake_graphs):
    model = _thin_model(tiny_dir)
    model.generation_config.disable_compile = False
    _, seen = _thin_generate_calls(model, _ids(2, 5, 7))
    call, kw = model._compiled_call, seen[-1]
    key = call.key((), kw)
    assert isinstance(key, tuple) and call.key((), dict(kw)) == key
    cname = _cache_name(kw)
    assert sorted(kw) == sorted(["attention_mask", cname, "input_ids", "logits_to_keep", "position_ids",
                                 "return_dict", "use_cache"])  # what transformers passes (a new name: a new key)
    assert isinstance(call.key((kw["input_ids"],), {}), str)                 # positional
    assert "object" in call.key((), {**kw, "odd": object()})                # a kwarg the key can't hold
    assert call.key((), {**kw, "logits_to_keep": 2}) != key                 # a static value
    assert call.key((), {**kw, "input_ids": kw["input_ids"].repeat(2, 1)}) != key  # a shape
    assert "strides" in call.key((), {**kw, "input_ids": kw["input_ids"].expand(2, 3)})
    lay = kw[cname].layers[0]
    keys = lay.keys
    lay.keys = keys.clone()                                                  # the cache at a new address
    assert call.key((), kw) != key
    lay.keys = keys
    with torch.enable_grad():
        assert call.key((), kw) == "autograd on"
    model.train()
    assert call.key((), kw) == "training mode"
    model.eval()
    call.require_cuda = True
    assert call.key((), {**kw, "input_ids": kw["input_ids"].cpu()}).endswith(": not a CUDA tensor")


@torch.no_grad()
def test_thin_graph_falls_back_and_invalidates(tiny_dir, fake_graphs, monkeypatch):
    """A capture that fails runs the compiled call for that key from then on (same tokens); weights moved
    (.data) or replaced (a new Parameter) drop every graph before the next replay."""
    model = _thin_model(tiny_dir)
    ids = _ids(2, 5, 8)
    model.generation_config.disable_compile = True
    want, _ = _generate(model, ids, cache_implementation="static")
    model.generation_config.disable_compile = False

    def broken(self, static):
        raise RuntimeError("operation not permitted when stream is capturing")

    with monkeypatch.context() as mp:
        mp.setattr(hf_patch.ThinGraphCall, "_record", broken)
        got, _ = _generate(model, ids, cache_implementation="static")
    assert torch.equal(got, want)
    stats = model._compiled_call.stats
    assert stats["warmups"] == 1 and stats["captures"] == 0 and stats["replays"] == 0
    assert sum(n for k, n in stats.items() if k.startswith("fallback: capture failed")) == 3, stats

    ln = model.transformer.ln_f
    for n, change in enumerate((lambda: setattr(ln.weight, "data", ln.weight.data.clone()),
                                lambda: setattr(ln, "bias", torch.nn.Parameter(ln.bias.detach().clone())))):
        (got, _), seen = _thin_generate_calls(model, ids)
        assert torch.equal(got, want)
        call = model._compiled_call
        assert call.stats["invalidated: weights"] == n
        change()
        _drop_last_token(seen[-1][_cache_name(seen[-1])])  # room for one more step in the full cache
        call(**seen[-1])  # the last step's key again (its cache still alive): the graph is dropped, not replayed
        assert call.stats["invalidated: weights"] == n + 1
        assert not any(isinstance(e, hf_patch._Graph) for e in call.entries.values())


def test_cuda_graphs_option(tiny_dir):
    cc = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
    m = hf_patch.patch(_load(tiny_dir), cuda_graphs=False)
    assert not isinstance(m.get_compiled_call(cc), hf_patch.ThinGraphCall)
    m._compiled_call = None
    m = hf_patch.patch(m)  # on by default
    assert isinstance(m.get_compiled_call(cc), hf_patch.ThinGraphCall)
    assert m.get_compiled_call(cc) is m.get_compiled_call(cc)
    hf_patch.patch(m, cuda_graphs=False)
    assert not isinstance(m.get_compiled_call(cc), hf_patch.ThinGraphCall)
    with pytest.raises(TypeError, match="cuda_graphs"):
        hf_patch.patch(m, cuda_graphs="yes")
    off = hf_patch._without_cudagraphs
    assert off({"backend": "inductor", "mode": "reduce-overhead"})["mode"] is None
    assert off({"backend": "inductor", "mode": "max-autotune"})["mode"] == "max-autotune-no-cudagraphs"
    got = off({"backend": "inductor", "mode": "reduce-overhead", "options": {"triton.cudagraphs": True}})
    assert got["mode"] is None and got["options"] == {"triton.cudagraphs": False}
    assert off({"backend": "eager", "mode": "reduce-overhead"})["mode"] == "reduce-overhead"


@pytest.mark.gpu
@torch.no_grad()
def test_thin_graph_generate_gpu(tiny_dir):
    """transformers' recipe (CompileConfig reduce-overhead) on the patched model: the decode steps replay
    ThinGraphCall's CUDA graphs (inductor without its own CUDA graphs). Three generates of different
    batch sizes and prompt lengths give the tokens (and logits) of the patched model eager; one warm-up
    and one capture per (batch, cache addresses) key, every later step a replay, no fallback; the repeat
    of the first shape compiles nothing and the capture itself compiles nothing."""
    model = hf_patch.patch(_load(tiny_dir), cuda_graphs=True)
    model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    torch._dynamo.reset()
    keys, real = [], hf_patch.ThinGraphCall.__call__

    def spy(self, *a, **k):
        cache = k.get("cache", k.get("past_key_values"))  # the name differs across transformers versions
        keys.append((k["input_ids"].shape[0], hf_patch._cache_key(cache)))
        return real(self, *a, **k)

    frames = []
    # dynamo's counters are the process's (an earlier test in this worker may have compiled): count from here
    base = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
    hf_patch.ThinGraphCall.__call__ = spy
    try:
        for b, t, seed in ((4, 8, 1), (2, 13, 2), (4, 8, 3)):
            ids = _ids(b, t, seed)
            model.generation_config.disable_compile = True
            want = model.generate(ids, **kw)
            model.generation_config.disable_compile = False
            got = model.generate(ids, **kw)
            assert torch.equal(got.sequences, want.sequences), (b, t)
            cmp.check(torch.stack(got.logits, 1), torch.stack(want.logits, 1), torch.float32,
                      what=f"thin-graph generate b={b} t={t}")
            frames.append(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0) - base)
    finally:
        hf_patch.ThinGraphCall.__call__ = real
    call = model._compiled_call
    assert isinstance(call, hf_patch.ThinGraphCall)
    distinct = len(set(keys))
    assert len(keys) == 3 * 7
    assert dict(call.stats) == {"warmups": distinct, "captures": distinct, "replays": len(keys) - distinct}, \
        (call.stats, distinct)
    # B=4 again compiles nothing; the new shape recompiled twice on the H100 (dynamo's automatic dynamic)
    assert frames[2] == frames[1] and frames[-1] <= 3, frames
