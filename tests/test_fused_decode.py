"""The fused decode step (one persistent launch per step: tritune.kernels.fused_decode through
tritune.model.engine.fused_decode): its logits and K/V writes equal today's per-op decode (and the float64
reference) within the harness tolerance; a missing dependency between stages is caught; the engine takes
it when asked and then generates the same tokens.

Interpreter: small GPT-2s, one launch per stage (programs run one after another there). GPU: the
persistent launch with its grid barriers, up to 48 layers, width 1600 and full contexts."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import copy
from dataclasses import replace

import pytest
import torch

from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime.compare import poison, rel_error, tolerance
from tritune.model.engine.fused_decode import FusedDecode, choose, fused_model, why_not
from tritune.model.gpt2.model import PagedKVCache
from tritune.references.fused_decode import fused_decode as reference

DEVICE = "cpu" if dev.interpreted() else "cuda"


def random_model(n_layer, n_embd, n_head, *, n_positions=64, vocab=101, dtype=torch.float32, seed=0):
    """Random GPT-2 weights, wide enough that logits differ from token to token (``tritune tune-decode``'s)."""
    from tritune.model.engine.fused_tune import random_model as rm

    return rm(n_layer, n_embd, n_head, dtype, DEVICE, n_positions=n_positions, vocab=vocab, seed=seed)


def step_case(model, ctx_lens, *, block_size=4, seed=1, pad_row=False):
    """A decode step of len(ctx_lens) rows over a cache of random K/V: row m attends ctx_lens[m] tokens
    (its new one included) through a shuffled block table; ``pad_row``: the last row is padding (slot -1)."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    M = len(ctx_lens)
    mb = -(-c.n_positions // block_size)
    cache = PagedKVCache(c, M * mb + 3, block_size, model.dtype, DEVICE)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    perm = torch.randperm(M * mb + 3, generator=g)[:M * mb].view(M, mb)
    bt = perm.to(torch.int32).to(DEVICE)
    pos = torch.tensor([n - 1 for n in ctx_lens])
    slots = (perm[torch.arange(M), pos // block_size] * block_size + pos % block_size).to(torch.int32)
    if pad_row:
        slots[-1] = -1
    ids = torch.randint(0, c.vocab_size, (M,), generator=g)
    return cache, ids.to(DEVICE), pos.to(DEVICE), slots.to(DEVICE), bt, torch.tensor(ctx_lens, dtype=torch.int32,
                                                                                     device=DEVICE)


def check_step(model, ctx_lens, *, pad_row=False, config=None, **run):
    """Fused vs per-op decode vs the float64 reference: logits and the caches they leave."""
    cache, ids, pos, slots, bt, ctx = step_case(model, ctx_lens, pad_row=pad_row)
    x = model.embed(ids, pos)
    ref = reference(x, model.w, cache.k_caches, cache.v_caches, slots, bt, ctx, n_head=model.config.n_head,
                    eps=model.config.layer_norm_epsilon)
    c_op = cache.clone()
    want = model.decode(ids, pos, c_op, slots, bt, ctx)
    c_fd = cache.clone()
    fd = FusedDecode(model, c_fd, config=config)
    for t in (fd.logits, fd.QKV, fd.A, fd.Hb):   # every scratch row read before it is written shows as NaN
        poison(t)
    got = fd(x.clone(), slots, bt, ctx, **run)
    fd.check()
    tol = tolerance(model.dtype)
    rows = slice(0, len(ctx_lens) - 1) if pad_row else slice(None)   # a padding row's logits are dropped
    # Against float64: the harness tolerance bounds one kernel's rounding; a deep bf16 stack compounds it (the
    # per-op path itself is 2.0e-2 off at 48 layers x 1600 on the H100), so the bar is the per-op path's own
    # error where that is larger, and the fused path may not be worse than it by more than a rounding's width.
    # The fused path against float64: within the tolerance, or no worse than the per-op path by more than a
    # quarter of it. Not also "within the tolerance of the per-op output" nor "within the tolerance whenever
    # the per-op path is": at 12 bf16 layers both paths are ~1% off float64, each rounding its activations
    # its own way, and such a bar is a coin toss at the edge (H100, GPT-2 small shapes, one row of 300
    # tokens: per-op 0.93e-2, fused up to 1.09e-2 by config, 1.08-1.16e-2 between them).
    err, err_op = rel_error(got[rows], ref[rows]), rel_error(want[rows], ref[rows])
    assert err <= max(tol, err_op + tol / 4), (err, err_op, rel_error(got[rows], want[rows]))
    assert rel_error(c_fd.k, c_op.k) <= tol and rel_error(c_fd.v, c_op.v) <= tol
    return fd, got


# ---------------------------------------------------------------------------------------------------
# Interpreter: small models, one launch per stage
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_layer,n_embd,n_head,ctx_lens", [
    (1, 64, 2, [5]),                   # one row: the FMA path
    (2, 128, 4, [9, 30, 1]),           # three rows: the tensor-core path, a row with only its new token
    (3, 96, 3, [17, 2]),               # head dim 32, 3 heads
    (4, 64, 1, [40]),                  # one head (the attention stage split by KV chunk only)
])
def test_fused_equals_per_op_fp32(n_layer, n_embd, n_head, ctx_lens):
    check_step(random_model(n_layer, n_embd, n_head), ctx_lens)


def test_fused_bf16_and_padding_row():
    check_step(random_model(2, 64, 2, dtype=torch.bfloat16, seed=4), [12, 7, 3], pad_row=True)


def test_split_k_and_kv_split_configs():
    """Explicit splits: every GEMV stage cut along K (partials merged by the last arrival), the attention
    cut into 4 KV chunks, 16-wide tiles over 3 programs (an odd count: uneven shares)."""
    m = random_model(2, 64, 2, seed=5)
    cfg = {"block_n": 16, "block_k": 16, "block_t": 16, "num_warps": 1, "programs": 3, "split_qkv": 2,
           "split_o": 4, "split_fc": 2, "split_proj": 8, "kv_split": 4}
    check_step(m, [33, 6], config=cfg)


@pytest.mark.parametrize("programs", [5, 13])   # 13: more programs than some stages' (tile, K block) units
def test_stream_k_equals_no_split_and_reference(programs):
    """Every GEMV stage (the LM head included) as stream-K: ranges of (tile, K block) units that begin and
    end inside tiles, partials merged by the tile's last arrival; odd widths (E 40, MLP 160, head dim 20,
    vocab 101 over 16-wide tiles). Against the reference, the per-op path, and the same step with no
    split at all (each program whole tiles over the full K)."""
    m = random_model(2, 40, 2, vocab=101, seed=21)
    base = {"block_n": 16, "block_k": 16, "block_t": 16, "num_warps": 1, "programs": programs}
    fd, got = check_step(m, [9, 3, 17], config=dict(base, stream_k=2))
    assert fd._plan(3)[2] == (0, 0, 0, 0, 0)
    fd1, off = check_step(m, [9, 3, 17], config=dict(base, stream_k=1, split_qkv=1, split_o=1, split_fc=1,
                                                     split_proj=1))
    assert fd1._plan(3)[2] == (1, 1, 1, 1, 1)
    assert rel_error(got, off) <= tolerance(m.dtype)


def test_split_plan_by_shape():
    """stream_k=0 takes stream-K only where the busiest program gets lighter: 140 column tiles on 132
    programs (uniform: 2 tiles x 6 blocks; stream-K: 7 blocks + 2 tickets); GPT-2 small's stages keep
    their uniform splits. stream_k=1 never, 2 always (explicit splits still win)."""
    from tritune.kernels import fused_decode as FK

    cfg = FK.Config(block_n=32, block_k=128)
    assert FK.plan_splits(768, 3072, 50257, cfg, 132) == (1, 3, 1, 5, 1)
    assert FK.plan_splits(768, 140 * 32, 50257, cfg, 132)[2] == 0
    assert FK.plan_splits(768, 140 * 32, 50257, replace(cfg, stream_k=1), 132)[2] == 1
    assert FK.plan_splits(768, 3072, 50257, replace(cfg, stream_k=2, split_o=2), 132) == (0, 2, 0, 0, 0)
    assert FK.work_floats((0, 2, 0, 0, 0), 768, 3072, 50257, cfg, 132, 1) == max(2 * 132, 24 * 2) * 32
    with pytest.raises(ValueError, match="stream_k"):
        FK.Config.from_dict({"stream_k": 3})
    # the LM head in blocks of its own: its stream-K partials are tiles of its width
    lm = replace(cfg, stream_k=2, lm_block_n=64, lm_block_k=256)
    assert FK.work_floats(FK.plan_splits(768, 3072, 50257, lm, 132), 768, 3072, 50257, lm, 132, 1) == 2 * 132 * 64
    for bad in ({"lm_block_n": 48}, {"kv_min_chunk": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FK.Config.from_dict(bad)


def test_shared_weights_keep_values():
    """share_weights: the model's layers become views of the stack (one copy), values unchanged."""
    m = random_model(2, 64, 2, seed=12)
    before = m.w.layers[1].w_fc.clone()
    fd = FusedDecode(m, PagedKVCache(m.config, 8, 4, m.dtype, DEVICE), share_weights=True)
    assert m.w.layers[1].w_fc.data_ptr() == fd.w["WFC"][1].data_ptr()
    assert torch.equal(m.w.layers[1].w_fc, before)
    check_step(m, [7])


def test_untied_lm_head_n_major():
    """An LM head stored (E, V) row-major (not the tied wte^T view): the LM stage's other load path."""
    m = random_model(1, 64, 2, seed=6)
    m2 = copy.copy(m)
    g = torch.Generator().manual_seed(9)
    m2.w = replace(m.w, lm_head=torch.randn(m.w.lm_head.shape, generator=g).to(DEVICE, m.dtype).contiguous())
    check_step(m2, [8])


@pytest.mark.skipif(not dev.interpreted(), reason="interpreter form of the test (programs in turn); on a GPU one "
                    "launch has its barriers: test_gpu_missing_barrier_gives_wrong_logits")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # it computes on unwritten rows
def test_missing_barrier_gives_wrong_logits():
    """The dependency test: every stage of every program in ONE launch with the barriers compiled out
    (the interpreter runs program 0's whole step before program 1 starts, so it reads rows the others have
    not written yet) must give wrong logits; the same code with a boundary between stages is right. So a
    missing or misplaced barrier cannot pass these tests."""
    m = random_model(2, 64, 2, seed=7)
    cache, ids, pos, slots, bt, ctx = step_case(m, [10, 4])
    x = m.embed(ids, pos)
    ref = reference(x, m.w, cache.k_caches, cache.v_caches, slots, bt, ctx, n_head=2)
    fd = FusedDecode(m, cache.clone())
    right = fd(x.clone(), slots, bt, ctx).clone()
    assert rel_error(right, ref) <= tolerance(m.dtype)
    fd = FusedDecode(m, cache.clone())
    wrong = fd(x.clone(), slots, bt, ctx, per_stage=False)   # sync=False on the interpreter: no barriers
    assert not rel_error(wrong, ref) <= 100 * tolerance(m.dtype)


def test_stage_prefix_runs_only_those_stages():
    """``stages=k`` (the benchmark's per-stage timing) stops after stage k: with the qkv stage alone, the
    new token's K/V are in the cache and nothing after it ran."""
    m = random_model(1, 64, 2, seed=8)
    cache, ids, pos, slots, bt, ctx = step_case(m, [6])
    c_op, c_fd = cache.clone(), cache.clone()
    m.decode(ids, pos, c_op, slots, bt, ctx)
    fd = FusedDecode(m, c_fd)
    poison(fd.A)
    fd(m.embed(ids, pos), slots, bt, ctx, stages=1)
    assert rel_error(c_fd.k, c_op.k) <= tolerance(m.dtype)
    assert torch.isnan(fd.A).all()


def test_engine_tokens_same_with_fused_decode():
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    m = random_model(2, 64, 2, seed=3)
    outs = []
    for fused in (False, True):
        eng = Engine(m, num_blocks=32, block_size=8, max_num_seqs=2, cuda_graphs="eager", fused_decode=fused,
                     decode_steps=4)
        assert any(("fused decode:" if fused else "fused decode off") in n for n in eng.notes), eng.notes
        done = eng.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(max_new_tokens=5))
        outs.append([c.token_ids for c in done])
    assert outs[0] == outs[1]


def test_choice_and_bad_input():
    m = random_model(1, 64, 2)
    cache = PagedKVCache(m.config, 8, 4, m.dtype, DEVICE)
    with pytest.raises(ValueError, match="fused_decode"):
        choose(m, cache, "yes", 1)
    assert choose(m, cache, False, 1)[0] is False
    assert choose(m, cache, True, 1)[0] is True
    use, why = choose(m, cache, "auto", 1)     # nothing measured on the interpreter: today's path
    assert not use and "not measured faster" in why
    m_torch = copy.copy(m)
    m_torch.backend = "torch"
    assert "backend" in why_not(m_torch)
    fd = FusedDecode(m, cache)
    x = torch.randn(9, 64, device=DEVICE)
    s = torch.zeros(9, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="x: expected 1..8 rows"):
        fd(x, s, torch.zeros((9, 2), dtype=torch.int32, device=DEVICE), s + 1)
    with pytest.raises(ValueError, match="x: expected a contiguous"):
        fd(x[:2].to(torch.float16), s[:2], torch.zeros((2, 2), dtype=torch.int32, device=DEVICE), s[:2] + 1)
    with pytest.raises(ValueError, match="config: unknown"):
        FusedDecode(m, cache, config={"tile": 3})
    fm = fused_model(m, cache)
    assert fm.fused.max_rows == 8 and m.decode is not fm.decode


# ---------------------------------------------------------------------------------------------------
# GPU: the persistent launch (grid barriers), real sizes
# ---------------------------------------------------------------------------------------------------
GPU_SHAPES = [  # (layers, width, heads, positions), rows, contexts
    ((12, 768, 12, 1024), [1], "small"),
    ((12, 768, 12, 1024), [1024, 1, 517, 64, 1000, 3, 256, 700], "small x8 full context"),
    ((24, 1024, 16, 1024), [333, 1024], "medium"),
    ((48, 1600, 25, 1024), [1024], "xl"),
    ((1, 64, 1, 128), [128, 1, 2, 3, 4, 5], "tiny"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,ctx_lens,label", GPU_SHAPES, ids=[s[2] for s in GPU_SHAPES])
def test_gpu_fused_equals_per_op(shape, ctx_lens, label):
    L, E, H, P = shape
    m = random_model(L, E, H, n_positions=P, vocab=50257, dtype=torch.bfloat16, seed=L)
    check_step(m, ctx_lens, pad_row=len(ctx_lens) > 2)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["stream", "off", "wide"])
@pytest.mark.parametrize("ctx_lens", [[300], [1024, 1, 517, 64, 9]], ids=["B1", "B5"])
def test_gpu_split_variants(variant, ctx_lens):
    """GPT-2 small's shapes in one persistent launch with stream-K in every GEMV stage (partials and
    tickets under real concurrency), with no split at all, or with 32 KB weight blocks: the reference and per-op logits, and the
    same logits bit for bit over 20 launches (the merge order is fixed; the tickets reset)."""
    m = random_model(12, 768, 12, n_positions=1024, vocab=50257, dtype=torch.bfloat16, seed=3)
    cfg = {"stream": {"stream_k": 2}, "off": {"split_qkv": 1, "split_o": 1, "split_fc": 1, "split_proj": 1,
                                            "stream_k": 1},
           # 32 KB weight blocks, the LM head's too
           "wide": {"block_k": 256, "block_n": 64, "stream_k": 2, "lm_block_n": 64, "lm_block_k": 256}}[variant]
    cfg = {**dict(block_n=32, block_k=128, block_t=32, num_warps=8), **cfg}
    fd, got = check_step(m, ctx_lens, pad_row=len(ctx_lens) > 2, config=cfg)
    assert (0 in fd._plan(len(ctx_lens))[2]) == (variant != "off")
    cache, ids, pos, slots, bt, ctx = step_case(m, ctx_lens)
    fd = FusedDecode(m, cache, config=cfg)
    x = m.embed(ids, pos)
    first = fd(x.clone(), slots, bt, ctx).clone()
    for _ in range(20):
        assert torch.equal(fd(x.clone(), slots, bt, ctx), first)
    assert int(fd.Tick.abs().sum()) == 0 and int(fd.Bar.abs().sum()) == 0
    fd.check()


@pytest.mark.gpu
def test_gpu_counters_reset_across_launches():
    """The barrier counters are zeroed by each launch's last program: 30 launches back to back give the
    same logits (a counter left behind would let a later launch run through its barriers)."""
    m = random_model(4, 256, 4, n_positions=256, vocab=5000, dtype=torch.bfloat16)
    cache, ids, pos, slots, bt, ctx = step_case(m, [200, 17, 1])
    fd = FusedDecode(m, cache)
    x = m.embed(ids, pos)
    first = fd(x.clone(), slots, bt, ctx).clone()
    for _ in range(30):
        assert torch.equal(fd(x.clone(), slots, bt, ctx), first)
    assert int(fd.Bar.abs().sum()) == 0
    fd.check()


@pytest.mark.gpu
def test_gpu_missing_barrier_gives_wrong_logits():
    """On the GPU: waits removed (DEBUG=1) while odd programs delay their stores (DEBUG=2) must give wrong
    logits; with the waits the same delays change nothing."""
    m = random_model(2, 256, 4, n_positions=256, vocab=5000, dtype=torch.bfloat16, seed=2)
    cache, ids, pos, slots, bt, ctx = step_case(m, [100, 40])
    x = m.embed(ids, pos)
    ref = reference(x, m.w, cache.k_caches, cache.v_caches, slots, bt, ctx, n_head=4)
    tol = tolerance(m.dtype)
    ok = FusedDecode(m, cache.clone())
    assert rel_error(ok(x.clone(), slots, bt, ctx), ref) <= tol
    fd = FusedDecode(m, cache.clone())
    bad = fd(x.clone(), slots, bt, ctx, debug=2, debug_spin=2000)
    torch.cuda.synchronize()
    assert not rel_error(bad, ref) <= 10 * tol


@pytest.mark.gpu
def test_gpu_engine_graphs_same_tokens():
    """The engine's CUDA graphs around the fused step (batch buckets 1..8) decode the same greedy tokens
    as the per-op step."""
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    m = random_model(6, 384, 6, n_positions=256, vocab=5000, dtype=torch.float32, seed=11)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5000, (int(n),), generator=g).tolist() for n in (3, 50, 17, 120, 9, 1, 33)]
    outs = []
    for fused in (False, True):
        eng = Engine(m, num_blocks=256, block_size=16, max_num_seqs=8, fused_decode=fused)
        done = eng.generate(prompts, SamplingParams(max_new_tokens=24))
        outs.append([c.token_ids for c in done])
        if fused:
            eng.runner.graphs.model.fused.check()
    assert outs[0] == outs[1]


# ---------------------------------------------------------------------------------------------------
# tritune tune-decode: the step's config searched, verified and stored like a kernel's
# ---------------------------------------------------------------------------------------------------
def test_tune_decode_verifies_records_failures_and_stores(tmp_path, monkeypatch, capsys):
    """Every point is checked against float64 before it is timed; a point that fails is a row of the
    table, not a crash; --export writes an entry the fused step and `tritune configs` accept."""
    import json

    from tritune.harness.cli import main
    from tritune.kernels.fused_decode import Config
    from tritune.model.engine import fused_tune

    real = fused_tune.candidates
    monkeypatch.setattr(fused_tune, "candidates",
                        lambda cur, points, seed: real(cur, points, seed) + [dict(cur, block_t=3)])
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path / "user"))
    # the tiny shape on a GPU too (its default there is GPT-2 small): the bucket below is the tiny model's
    assert main(["tune-decode", "--shape", "tiny", "--points", "1", "--reps", "1", "--export",
                 "--configs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "block_t must be a power of two" in out          # the bad point, recorded
    assert "2/3" in out                                     # two of three points verified
    (path,) = tmp_path.glob("*/fused_decode.json")
    (entry,) = json.loads(path.read_text())["entries"]
    assert entry["bucket"] == "E=64,F=256,H=2,M=1" and entry["trials"] == 3
    Config.from_dict(entry["config"])
    assert main(["configs", "fused_decode", "--configs-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].rstrip().endswith("active")


@pytest.mark.parametrize("argv,msg", [(["--batches", "9"], "--batches"), (["--batches", "x"], "--batches"),
                                      (["--model", "/no/such/dir"], "--model"), (["--points", "-1"], "--points")])
def test_tune_decode_refuses_bad_arguments_in_one_line(argv, msg, capsys):
    from tritune.harness.cli import main

    assert main(["tune-decode", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0] and "Traceback" not in err[0]
