"""Batch-invariant mode (Engine(..., batch_invariant=True), tritune.model.engine.invariant): every request's
logits, and so its token ids, bit for bit those it gets alone, whatever shares its steps, with
preemption (recompute by prefill) forced; a token's logits the same prefilled or decoded.

CPU: the torch backend (whose own fp32 addmm follows M: the default mode differs, checked below) and
the triton backend through the interpreter (fp32: the interpreter's bf16 dot is wrong). GPU: 64 requests
of random lengths, greedy and seeded sampling, bf16 / fp32 / int4, CUDA graphs on."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import contextlib
import random

import pytest
import torch

from tritune.model.engine import invariant
from tritune.model.engine.engine import Engine
from tritune.model.engine.scheduler import SamplingParams
from tests.test_engine import VOCAB, tiny_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (64 requests on the real model)")


def requests(n, seed, lo, hi, max_new, vocab=VOCAB - 1):
    """n prompts of random lengths in [lo, hi), half greedy, half sampled with a seed of their own."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))]
        sp = SamplingParams(max_new_tokens=rng.randrange(max_new // 2, max_new + 1), ignore_eos=True,
                            temperature=0.0 if i % 2 else 0.8, top_k=0 if i % 4 else 20, seed=1000 + i)
        out.append((p, sp))
    return out


class Recorder:
    """The engine's sampler, keeping every logits row it is handed, per request."""

    def __init__(self, base):
        self.base, self.logits = base, {}

    def __call__(self, reqs, logits):
        for r, row in zip(reqs, logits):
            self.logits.setdefault(r.id, []).append(row.float().cpu().clone())
        return self.base(reqs, logits)

    def __getattr__(self, name):   # the rest of the sampler's interface (release, failures...) is the base's
        return getattr(self.base, name)


def run(model, reqs, record=False, **kw):
    """Token ids (and with ``record`` the host-sampled logits rows) of each request, all in one engine."""
    eng = Engine(model, **kw)
    if record:
        eng.sampler = Recorder(eng.sampler)
    handles = [eng.add_request(p, sp) for p, sp in reqs]
    eng.run()
    assert all(h.finish_reason == "length" for h in handles)
    assert eng.pool.num_free == eng.pool.num_blocks
    logits = [eng.sampler.logits.get(h.id, []) for h in handles] if record else None
    eng.handles = handles
    return [h.output_ids for h in handles], logits, eng


def check_invariant(model, reqs, batched_kw, alone_kw, record=True):
    toks, logits, eng = run(model, reqs, record=record, batch_invariant=True, **batched_kw)
    assert eng.stats["preemptions"] > 0, "the pool was meant to force preemption"
    alone = Engine(model, batch_invariant=True, **alone_kw)     # one request at a time
    if record:
        alone.sampler = Recorder(alone.sampler)
    bad = []
    for i, (p, sp) in enumerate(reqs):
        h = alone.add_request(p, sp)
        alone.run()
        t1, l1 = [h.output_ids], [alone.sampler.logits.get(h.id, [])] if record else None
        if t1[0] != toks[i]:
            bad.append(i)
        elif record and eng.handles[i].num_preemptions == 0:
            # (a preempted request's logits rows repeat positions: its tokens are what is compared)
            assert len(l1[0]) == len(logits[i]) and all(torch.equal(a, b) for a, b in zip(l1[0], logits[i])), i
    assert not bad, f"requests {bad} of {len(reqs)} differ from the same request alone"
    return toks, eng


# ---------------------------------------------------------------------------------------------------
# CPU: torch backend
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_model():
    return tiny_model("torch", n_layer=2, n_embd=64, n_head=2, n_positions=96)


def test_torch_cpu_matmul_follows_the_batch_so_the_mode_needs_rows():
    """Why the torch backend computes linears row by row in this mode: a row of fp32 addmm differs
    inside a bigger product (MKL/oneDNN pick their blocking by M). If this ever stops differing, the
    row loop is still correct, only slower."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(37, 768, generator=g), torch.randn(768, 2304, generator=g),
               torch.randn(2304, generator=g))
    full = torch.addmm(b, x, w)
    rows = torch.cat([torch.addmm(b, x[i:i + 1], w) for i in range(37)])
    ops = invariant.TorchInvariantOps(None, 96)
    assert torch.equal(ops.linear(x, w, b), rows)
    assert torch.equal(ops.linear(x[5:9], w, b), rows[5:9])
    if torch.equal(full, rows):
        pytest.skip("this CPU's addmm is row-invariant at these sizes")


@contextlib.contextmanager
def threads(n):
    """torch's CPU thread count set to ``n`` (None: left as it is) for the block, then restored."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# 5 threads: a whole-batch F.gelu's per-thread chunks then end off the vector width (a 2-core machine's
# default of 2 never does), which is how a 16-core GPU host caught a logits row differing
@pytest.mark.parametrize("n_threads", [None, 5])
def test_torch_backend_batched_equals_alone_with_preemption(torch_model, n_threads):
    reqs = requests(12, seed=7, lo=2, hi=40, max_new=14)
    # 30 blocks of 4 tokens for 12 requests of up to 54 tokens: the newest keep being preempted
    with threads(n_threads):
        check_invariant(torch_model, reqs, dict(num_blocks=30, block_size=4, cuda_graphs=False),
                        dict(num_blocks=40, block_size=4, cuda_graphs=False))


def test_torch_cpu_gelu_follows_the_thread_chunks():
    """Why the mode applies GELU row by row: over a (T, 4E) tensor, the CPU kernel gives each thread a
    chunk and computes a chunk's tail with the scalar tanh, whose bits differ from the vector one."""
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(99, 256, generator=g)
    with threads(5):
        full = torch.nn.functional.gelu(x, approximate="tanh")
        rows = torch.cat([torch.nn.functional.gelu(r.clone(), approximate="tanh") for r in x.split(1)])
    if torch.equal(full, rows):
        pytest.skip("this CPU's gelu kernel is row-invariant at 5 threads")


@pytest.mark.parametrize("n_threads", [None, 5])
def test_torch_ops_rows_ignore_the_batch_threads_and_alignment(n_threads):
    """Each op of the torch backend's mode gives a row the bits it gives that row alone: inside a 99-row
    batch, and from a view whose data starts off the allocator's alignment (4 bytes past it), since
    libraries pick kernels by pointer alignment (cuBLAS, CUDA LayerNorm, MKL)."""
    g = torch.Generator().manual_seed(1)
    T, E = 99, 64
    ops = invariant.TorchInvariantOps(None, 96)
    w, b = torch.randn(E, 4 * E, generator=g) / 8, torch.randn(4 * E, generator=g)
    w2, b2 = torch.randn(4 * E, E, generator=g) / 16, torch.randn(E, generator=g)
    lw, lb = 1 + 0.1 * torch.randn(E, generator=g), 0.1 * torch.randn(E, generator=g)
    x = 3 * torch.randn(T, E, generator=g)
    odd = torch.empty(T * E + 1)[1:].view(T, E)          # same values, data 4 bytes off alignment
    odd.copy_(x)
    assert odd.data_ptr() % 16 != 0

    def step(x):
        h = ops.layer_norm(x, lw, lb, 1e-5)
        f = ops.linear(h, w, b, activation="gelu_tanh")
        return ops.linear(f, w2, b2, residual=x)

    with threads(n_threads):
        batched, shifted = step(x), step(odd)
        alone = torch.cat([step(x[i:i + 1].clone()) for i in range(T)])
    assert torch.equal(batched, alone) and torch.equal(shifted, alone)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_torch_backend_quantized_batched_equals_alone(quant):
    m = tiny_model("torch", n_layer=1, n_embd=64, n_head=2, n_positions=64, seed=5)
    reqs = requests(6, seed=8, lo=2, hi=30, max_new=10)
    check_invariant(m, reqs, dict(num_blocks=14, block_size=4, cuda_graphs=False, quant=quant, group_size=32),
                    dict(num_blocks=16, block_size=4, cuda_graphs=False, quant=quant, group_size=32))


def test_default_mode_is_not_invariant_on_the_torch_cpu(torch_model):
    """The test above has teeth: without the mode, some logits row of some request differs in its bits."""
    reqs = requests(6, seed=7, lo=2, hi=40, max_new=8)
    _, lb, _ = run(torch_model, reqs, record=True, num_blocks=200, block_size=4, cuda_graphs=False)
    differ = 0
    for i, r in enumerate(reqs):
        _, la, _ = run(torch_model, [r], record=True, num_blocks=200, block_size=4, cuda_graphs=False)
        differ += any(not torch.equal(a, b) for a, b in zip(la[0], lb[i]))
    if not differ:
        pytest.skip("this CPU's kernels happened to be row-invariant for these sizes")


def prefill_vs_decode(model, block_size=4):
    """Logits of a sequence's last token: prefilled with all of it, decoded after a prefill of all but
    it, and decoded token by token after a prefill of 5: the runner's eager forward in this mode, on
    blocks 0, 1, ... of an idle engine's pool (a fresh engine each time)."""
    seq = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
    slots = list(range(len(seq)))
    table = list(range(-(-len(seq) // block_size)))
    outs = []
    for split in (len(seq), len(seq) - 1, 5):
        eng = Engine(model, num_blocks=len(table) + 1, block_size=block_size, cuda_graphs=False,
                     batch_invariant=True)
        r = eng.runner
        with torch.inference_mode():
            logits = r.eager([seq[:split]], [slots[:split]], [], [], [], [], [])
            for p in range(split, len(seq)):
                logits = r.eager([], [], [seq[p]], [p], [slots[p]], [p + 1], [table])
        outs.append(logits[-1].float().cpu().clone())
    return outs


def test_prefill_and_decode_of_a_token_give_the_same_logits(torch_model):
    full, one, many = prefill_vs_decode(torch_model)
    assert torch.equal(full, one) and torch.equal(full, many)


def test_options_and_report(torch_model):
    with pytest.raises(ValueError, match="compile"):
        Engine(torch_model, num_blocks=8, cuda_graphs=False, compile=True, batch_invariant=True)
    eng = Engine(torch_model, num_blocks=8, cuda_graphs=False, batch_invariant=True)
    assert eng.describe()["batch_invariant"] and "row by row" in eng.model.backend_report()
    mm = invariant.invariant_model(torch_model)
    assert invariant.invariant_model(mm) is mm and mm.ops.steps["linear"].endswith("(batch-invariant)")


# ---------------------------------------------------------------------------------------------------
# CPU: triton backend through the interpreter (tiny, fp32)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run; the GPU runs the tests below")
def test_triton_backend_interpreter_batched_equals_alone(monkeypatch):
    # 16-token KV chunks: contexts past one chunk take the split-KV merge (its chunk count the row's own)
    monkeypatch.setattr(invariant, "PARTITION_TOKENS", 16)
    invariant.paged_config.cache_clear()
    monkeypatch.setattr(invariant, "paged_config", invariant.paged_config.__wrapped__)
    # one K tile per slice: the MLP's down projection (K = 128, 64-long fp32 K tiles) runs split-K
    monkeypatch.setattr(invariant, "SLICE_K_TILES", 1)
    monkeypatch.setattr(invariant, "gemm_config", invariant.gemm_config.__wrapped__)
    assert invariant.gemm_config(32, 128, False, True, None, True, torch.float32)["SPLIT_K"] == 2
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=4)
    reqs = requests(4, seed=9, lo=8, hi=20, max_new=10)
    check_invariant(m, reqs, dict(num_blocks=10, block_size=4, cuda_graphs=False),
                    dict(num_blocks=12, block_size=4, cuda_graphs=False))
    full, one, many = prefill_vs_decode(m)
    assert torch.equal(full, one) and torch.equal(full, many)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run (fp32; its bf16 dot is wrong)")
@pytest.mark.parametrize("slice_k_tiles", [invariant.SLICE_K_TILES, 1], ids=["pinned", "split-K"])
def test_triton_ln_linear_is_layer_norm_then_linear_and_row_invariant(monkeypatch, slice_k_tiles):
    """ops.ln_linear (the LayerNorm in the pinned gemm's prologue, the qkv's K/V write in its epilogue)
    matches layer_norm then linear, and gives a row alone the bits it gets inside a 37-row batch (rows at
    each tile's edges; the interpreter runs a launch in Python); the
    cache holds exactly the k, v columns of the output at each row's slot (split-K: every slice computes
    the rows' statistics itself)."""
    from tritune.kernels.runtime import compare as cmp
    from tritune.references.gemm import gemm as ref_gemm

    monkeypatch.setattr(invariant, "SLICE_K_TILES", slice_k_tiles)
    monkeypatch.setattr(invariant, "gemm_config", invariant.gemm_config.__wrapped__)
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=64, seed=4)
    ops = invariant.invariant_model(m).ops
    g = torch.Generator().manual_seed(2)
    T, E, K = 37, 48, 160                           # K: 3 fp32 K tiles, the last one partial
    x = 2 * torch.randn(T, K, generator=g) + 0.5
    lw, lb = 1 + 0.2 * torch.randn(K, generator=g), 0.1 * torch.randn(K, generator=g)
    w_qkv, b_qkv = torch.randn(K, 3 * E, generator=g) / 12, 0.1 * torch.randn(3 * E, generator=g)
    w_fc, b_fc = torch.randn(K, 4 * E, generator=g) / 12, 0.1 * torch.randn(4 * E, generator=g)
    head = torch.randn(61, K, generator=g) / 12      # a tied LM head: (V, K) read as its transpose
    cfg = invariant.gemm_config(3 * E, K, False, True, None, False, torch.float32, ln=True, kv=True)
    assert cfg["SPLIT_K"] == (1 if slice_k_tiles > 1 else 2)

    def caches():
        c = torch.full((12, 4, 2, E // 2), float("nan"))
        return c, c.clone()

    slots = torch.randperm(48, generator=g)[:T]
    slots[::7] = -1
    for w, b, act, kv in ((w_qkv, b_qkv, None, True), (w_fc, b_fc, "gelu_tanh", False), (head.t(), None, None, False)):
        kc, vc = caches()
        y, written = ops.ln_linear(x, lw, lb, 1e-5, w, b, activation=act, kv=(kc, vc, slots) if kv else None)
        assert written == kv
        want = ref_gemm(x, w, b, activation=act, ln=(lw, lb, 1e-5))
        cmp.check(y, want, torch.float32, "ieee", what=f"ln_linear N={w.shape[1]}")
        two = ops.linear(ops.layer_norm(x, lw, lb, 1e-5), w, b, activation=act)
        cmp.check(y, two.double(), torch.float32, "ieee", what="against layer_norm then linear")
        for i in (0, 6, 15, 16, 31, 36):          # each 16-row tile's edges, the last (partial) tile's last row
            kc1, vc1 = caches()
            y1, _ = ops.ln_linear(x[i:i + 1].clone(), lw, lb, 1e-5, w, b, activation=act,
                                  kv=(kc1, vc1, slots[i:i + 1].clone()) if kv else None)
            assert torch.equal(y1[0], y[i]), (w.shape, i)
        if kv:
            flat_k, flat_v = kc.view(48, E), vc.view(48, E)
            for i, s in enumerate(slots.tolist()):
                if s >= 0:
                    assert torch.equal(flat_k[s], y[i, E:2 * E]) and torch.equal(flat_v[s], y[i, 2 * E:])
            assert flat_k[[s for s in range(48) if s not in set(slots.tolist())]].isnan().all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="counted through the interpreter (on a GPU a plan's later "
                    "launches bypass triton's run, which this counts)")
def test_invariant_decode_step_has_the_default_steps_launch_count(monkeypatch):
    """One decode step at batch 1 (what the engine captures): the batch-invariant mode launches as many
    kernels as the default mode (gemv with the LayerNorm and the K/V write fused in): no LayerNorm or
    write_kv launch of its own, the same count per layer."""
    from tritune.kernels import gemm as GM

    launches = []
    cls = type(GM._gemm_kernel)
    run = cls.run

    def counting(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run", counting)
    m = tiny_model("triton", n_layer=2, n_embd=32, n_head=2, n_positions=64, seed=4)
    counts = {}
    for name, model in (("default", m), ("invariant", invariant.invariant_model(m))):
        cache = model.new_cache(16, block_size=4)
        with torch.inference_mode():        # the prompt's K/V, then the one step counted
            model.prefill(torch.arange(5), [5], kv_cache=cache, slot_mapping=torch.arange(5))
            launches.clear()
            logits = model.decode(torch.tensor([7]), torch.tensor([5]), cache, torch.tensor([5]),
                                  torch.arange(4, dtype=torch.int32)[None], torch.tensor([6], dtype=torch.int32))
        assert logits.shape == (1, VOCAB)
        counts[name] = list(launches)
    for name, names in counts.items():
        assert not [k for k in names if "layer_norm" in k or "write_kv" in k], (name, names)
    kinds = {name: ["linear" if "gemm" in k or "gemv" in k else k for k in names] for name, names in counts.items()}
    assert kinds["invariant"] == kinds["default"], counts
    assert sum("gemm" in k for k in counts["invariant"]) == 4 * 2 + 1       # 4 linears a layer + the LM head


def test_pinned_configs_do_not_depend_on_rows():
    """The configs are functions of (N, K, dtype) etc. only, and valid at every row count."""
    from tritune.kernels import gemm as GM, layer_norm as LN, paged_attention as PA

    for dt in (torch.float32, torch.bfloat16):
        for N, K in ((2304, 768), (768, 3072), (256, 1024), (50257, 768)):
            cfg = invariant.gemm_config(N, K, False, True, None, False, dt)
            assert cfg["BLOCK_M"] == 16 and cfg["GROUP_M"] == 1 and not cfg["PERSISTENT"]
            # with the LayerNorm prologue: pointer operands; the K/V write never changes the config (the qkv
            # product has the same bits whether it writes the cache itself or write_kv does)
            lcfg = invariant.gemm_config(N, K, False, True, None, False, dt, ln=True)
            assert not lcfg["TMA"] and not lcfg["PERSISTENT"]
            assert invariant.gemm_config(N, K, False, True, None, False, dt, ln=True, kv=N % 3 == 0) == lcfg
            for M in (1, 7, 4096):
                assert GM.SPEC.space.why_invalid(lcfg, GM.Problem(M, N, K, bias=True, ln=True), dt) is None
            # split-K at most until a slice fits one pipeline fill, the 1-row grid under half a wave
            k_tiles = -(-K // cfg["BLOCK_K"])
            split = cfg["SPLIT_K"]
            assert split == 1 or -(-k_tiles // (split // 2)) > invariant.SLICE_K_TILES
            assert split == 1 or -(-N // cfg["BLOCK_N"]) * split <= GM._num_sms()
            for M in (1, 3, 16, 17, 1000, 8192):
                assert GM.SPEC.space.why_invalid(cfg, GM.Problem(M, N, K, bias=True), dt) is None
        assert invariant.gemm_config(768, 3072, False, True, None, True, torch.bfloat16)["SPLIT_K"] > 1
        lc = invariant.layer_norm_config(768, dt)
        for M in (1, 5, 4096):
            assert lc["ROWS"] == 1 and LN.SPEC.space.why_invalid(lc, LN.Problem(M, 768), dt) is None
        pc = invariant.paged_config(12, 12, 64, 16, 1024, dt)
        assert pc["PARTITION"] == invariant.PARTITION_TOKENS
        assert invariant.paged_config(12, 12, 64, 16, 256, dt)["PARTITION"] == 64
        for B in (1, 7, 256):
            assert PA.SPEC.space.why_invalid(pc, PA.Problem(B, 12, 12, 64, 1024, 16), dt) is None


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
def _gpu_model(dtype):
    from tritune.model.load import default_model_dir
    from tritune.model.gpt2.model import GPT2

    d = default_model_dir()
    if d is None:
        pytest.skip("no packaged model")
    return GPT2.from_pretrained(d, backend="triton", dtype=dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,quant", [(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, "int4")])
def test_gpu_64_requests_batched_equal_alone(dtype, quant):
    m = _gpu_model(dtype)
    V = m.config.vocab_size
    hi = min(300, m.config.n_positions - 48)
    reqs = requests(64, seed=11, lo=4, hi=hi, max_new=48, vocab=V)
    bs = 16
    # blocks for ~12 sequences at full length: 64 requests keep preempting each other
    nb = 12 * -(-(hi + 48) // bs)
    toks, eng = check_invariant(m, reqs, dict(num_blocks=nb, block_size=bs, quant=quant, max_num_seqs=64),
                                dict(num_blocks=-(-m.config.n_positions // bs), block_size=bs, quant=quant,
                                     max_num_seqs=1), record=False)
    assert eng.graphs is not None and eng.stats["graph_steps"] > 0      # CUDA graphs still used


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_prefill_and_decode_of_a_token_give_the_same_logits(dtype):
    m = _gpu_model(dtype)
    full, one, many = prefill_vs_decode(m, 16)
    assert torch.equal(full, one) and torch.equal(full, many)


def test_generate_cli_deterministic_matches_a_batched_engine():
    """``tritune generate --deterministic`` (the packaged model, torch backend on the CPU) gives the tokens a
    batch-invariant engine gives the same prompt beside others."""
    import subprocess
    import sys

    from tritune.model.load import default_model_dir
    from tritune.model.gpt2.model import GPT2
    from tritune.model.tokenizer import Tokenizer

    d = default_model_dir()
    if d is None:
        pytest.skip("no packaged model")
    prompt = "The quick brown fox"
    r = subprocess.run([sys.executable, "-c", "import sys; from tritune.harness.cli import main; sys.exit(main())",
                        "generate", prompt, "--max-new-tokens", "6",
                        "--deterministic", "--temperature", "0", "--backend", "torch", "--dtype", "fp32"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = GPT2.from_pretrained(d, backend="torch", dtype=torch.float32, device="cpu")
    tok = Tokenizer.from_dir(m.directory)
    eng = Engine(m, num_blocks=64, cuda_graphs=False, batch_invariant=True, tokenizer=tok)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    res = eng.generate([prompt, "Other text that shares the steps, longer than the first one", "x"], sp)
    assert r.stdout.rstrip("\n") == prompt + res[0].text
