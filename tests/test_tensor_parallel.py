"""Tensor parallelism on the CPU (gloo, the torch backend, fp32): 2 and 4 ranks give the greedy tokens one
rank gives, every rank's KV cache holds its heads of the same blocks, a dead rank is reported, not waited
for. The ranks are spawned processes (tritune.model.parallel.launch); each test launches once and checks
several things, since starting a rank (importing torch) is most of the cost."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from tritune.kernels.runtime.compare import check
from tritune.model.engine.engine import Engine
from tritune.model.engine.sampling import SamplingParams
from tritune.model.gpt2 import weights as GW
from tritune.model.gpt2.config import GPT2Config
from tritune.model.gpt2.model import GPT2
from tritune.model.llama import weights as LW
from tritune.model.llama.config import LlamaConfig
from tritune.model.llama.model import Llama
from tritune.model.load import default_model_dir
from tritune.model.parallel import plan as P
from tritune.model.parallel import serving
from tritune.model.parallel.group import single
from tritune.model.parallel.launch import RankFailed, launch
from tritune.model.parallel.model import tensor_parallel

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 32


def _random_state(shapes: dict, seed: int, scale: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(s, generator=g) * scale if len(s) > 1 else 1 + 0.1 * torch.randn(s, generator=g))
            for k, s in shapes.items()}


def gpt2_model():
    """The packaged GPT-2 (trained: greedy tokens far from ties), or a small random one without it."""
    d = default_model_dir()
    if d is not None:
        return GPT2.from_pretrained(d, backend="torch", dtype=torch.float32, device="cpu")
    c = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=1000)
    return GPT2(c, GW.to_layout(c, _random_state(GW.expected_shapes(c), 0, 0.2), torch.float32, "cpu"),
                backend="torch")


def llama_model(n_kv_head: int = 2):
    """A random Llama-shaped model: GQA (8 query heads), every bias, an untied head, a vocabulary no rank
    count divides (the padded shards)."""
    c = LlamaConfig(model_type="llama", n_layer=2, n_head=8, n_kv_head=n_kv_head, n_embd=64, d_mlp=96,
                    n_positions=128, vocab_size=1001, head_dim=8, qkv_bias=True, o_bias=True, mlp_bias=True)
    return Llama(c, LW.to_layout(c, _random_state(LW.expected_shapes(c), 1, 0.3), torch.float32, "cpu"),
                 backend="torch")


def prompts(vocab: int):
    g = np.random.default_rng(3)
    a = g.integers(1, vocab, 20).tolist()
    return [a, g.integers(1, vocab, 7).tolist(), a[:16] + g.integers(1, vocab, 5).tolist()]


def serve(model, group=None):
    """Greedy tokens of the prompts through an Engine over ``model``; on a group, rank 0 leads and the
    others follow. Returns what the tests compare (numpy and plain values only)."""
    ps = prompts(model.vocab_size)
    if group is not None and group.rank != 0:
        ledger, pool = serving.follow(group, model)
        return {"ledger": ledger.summary(), "num_blocks": pool.num_blocks, "cache": pool.cache.numpy().copy()}
    eng = Engine(model, num_blocks=NUM_BLOCKS)      # on a group's rank 0 it leads the others (tp_lead)
    tokens = [c.token_ids for c in eng.generate(ps, GREEDY)]
    out = {"tokens": tokens, "num_free": eng.pool.num_free, "peak_used": eng.pool.peak_used,
           "num_blocks": eng.pool.num_blocks, "cache": eng.pool.cache.numpy().copy()}
    eng.close()
    if group is not None:
        out["ledger"] = eng.tp_lead.ledger.summary()
    return out


def rank_main(group):
    """Every rank: the GPT-2 and the Llama shards served; their prefill logits too."""
    out = {}
    for name, make in (("gpt2", gpt2_model), ("llama", llama_model)):
        m = tensor_parallel(make(), group)
        ids = torch.tensor(prompts(m.vocab_size)[0])
        out[name + "_logits"] = m.prefill(ids, [len(ids)], all_logits=True).numpy()
        out[name] = serve(m, group)
    return out


@pytest.fixture(scope="module")
def reference():
    """One rank's results (in this process)."""
    out = {}
    for name, make in (("gpt2", gpt2_model), ("llama", llama_model)):
        m = make()
        ids = torch.tensor(prompts(m.vocab_size)[0])
        out[name + "_logits"] = m.prefill(ids, [len(ids)], all_logits=True).numpy()
        out[name] = serve(m)
        out[name + "_model"] = m
    return out


def heads_of(model, rank: int, world: int) -> list[int]:
    s = P.Shard.of(model.config, P.plan_for(model), rank, world)
    return list(range(s.kv_first(), s.kv_first() + s.local_kv_heads))


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_one_rank(world, reference):
    t0 = time.monotonic()
    ranks = launch(world, rank_main, timeout_s=240)
    assert time.monotonic() - t0 < 240
    for name in ("gpt2", "llama"):
        ref, lead = reference[name], ranks[0][name]
        assert lead["tokens"] == ref["tokens"], name            # greedy tokens equal to one rank's
        for r in range(world):                                  # every rank gets the whole logits
            check(torch.from_numpy(ranks[r][name + "_logits"]), torch.from_numpy(reference[name + "_logits"]))
        # block accounting: one allocator (rank 0), exact, and every rank's cache holds its heads of the
        # same blocks the one-rank engine wrote
        assert lead["num_free"] == lead["num_blocks"] == NUM_BLOCKS
        assert lead["peak_used"] == ref["peak_used"]
        model = reference[name + "_model"]
        used = sorted({b for b in range(NUM_BLOCKS) if np.any(ref["cache"][:, :, b])})
        for r in range(world):
            got = ranks[r][name]
            assert got["num_blocks"] == NUM_BLOCKS
            assert got["ledger"] == lead["ledger"]
            assert sorted({b for b in range(NUM_BLOCKS) if np.any(got["cache"][:, :, b])}) == used
            heads = heads_of(model, r, world)
            check(torch.from_numpy(got["cache"][:, :, used]),
                  torch.from_numpy(ref["cache"][:, :, used][..., heads, :]), what=f"{name} rank {r} KV")


SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=5, ignore_eos=True)


def serve_graphs(model, group=None):
    """Greedy and sampled tokens through an Engine whose decode runs the device-side step (``"eager"``: the
    graphs' own step without capture, the CPU's way through the same loads, replays and fed tokens)."""
    if group is not None and group.rank != 0:
        ledger, _ = serving.follow(group, model)
        return {"ledger": ledger.summary()}
    eng = Engine(model, num_blocks=NUM_BLOCKS, cuda_graphs="eager")
    assert eng.runner.graphs is not None
    ps = prompts(model.vocab_size)
    out = {"greedy": [c.token_ids for c in eng.generate(ps, GREEDY)],
           "sampled": [c.token_ids for c in eng.generate(ps[:2], SAMPLED)], "paths": dict(eng.path_counts)}
    eng.close()
    return out


def rank_graphs(group):
    return {name: serve_graphs(tensor_parallel(make(), group), group)
            for name, make in (("gpt2", gpt2_model), ("llama", llama_model))}


def test_decode_graph_steps_are_replayed_on_every_rank():
    """Two ranks running the device-side decode step (rank 0's loads, replays and sampled tokens broadcast)
    give one rank's greedy and sampled tokens, and the steps did take the graph path."""
    ranks = launch(2, rank_graphs, timeout_s=240)
    for name, make in (("gpt2", gpt2_model), ("llama", llama_model)):
        one = serve_graphs(make())
        assert ranks[0][name]["greedy"] == one["greedy"], name
        assert ranks[0][name]["sampled"] == one["sampled"], name
        assert ranks[0][name]["paths"].get("graph", 0) > 0, ranks[0][name]["paths"]


class DieAfter:
    """A follower's ops that end the process (exit code 7) in the middle of a forward after ``n`` linears."""

    def __init__(self, base, n: int):
        self.base, self.n = base, n

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def linear(self, *args, **kw):
        self.n -= 1
        if self.n < 0:
            os._exit(7)
        return self.base.linear(*args, **kw)


def rank_dies(group):
    m = tensor_parallel(gpt2_model(), group)
    if group.rank == 1:
        m = m.with_ops(DieAfter(m.ops, 200))
    return serve(m, group)


def idle_leader(group):
    """Rank 0 stays silent past the collective timeout between two messages (a server between requests)."""
    got = [group.broadcast_object("first" if group.rank == 0 else None)]
    if group.rank == 0:
        time.sleep(4.0)
    got.append(group.broadcast_object("second" if group.rank == 0 else None))
    return got


def test_a_follower_waits_out_an_idle_leader():
    assert launch(2, idle_leader, timeout_s=60, collective_timeout_s=1.5) == [["first", "second"]] * 2


def test_a_dead_rank_is_reported_not_waited_for():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as e:
        launch(2, rank_dies, timeout_s=120, collective_timeout_s=30)
    assert e.value.rank == 1 and e.value.exitcode == 7, e.value.failures
    assert "rank 1" in str(e.value) and "exit code 7" in str(e.value)
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------------------------------------
# One process: the plans and shards themselves
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [llama_model, gpt2_model])
def test_one_rank_is_the_model_itself(make):
    m = make()
    ids = torch.tensor(prompts(m.vocab_size)[1])
    want = m.prefill(ids, [len(ids)])
    assert torch.equal(tensor_parallel(m, single()).prefill(ids, [len(ids)]), want)
    # cut where the model is, then moved (here "cpu:0", another name of the same device: the rebuild path)
    moved = tensor_parallel(m, single(), device="cpu:0")
    assert moved.w.wte is not m.w.wte and torch.equal(moved.prefill(ids, [len(ids)]), want)


def test_kv_heads_divided_or_replicated():
    cfg = llama_model(2).config
    # 8 query heads, 2 KV heads: 2 ranks divide them, 4 ranks share each KV head between two ranks
    assert [P.Shard.of(cfg, P.LLAMA_PLAN, r, 2).kv_first() for r in range(2)] == [0, 1]
    assert [P.Shard.of(cfg, P.LLAMA_PLAN, r, 4).kv_first() for r in range(4)] == [0, 0, 1, 1]
    assert P.Shard.of(cfg, P.LLAMA_PLAN, 0, 4).local_kv_heads == 1
    with pytest.raises(ValueError, match="attention heads"):
        P.Shard.of(cfg, P.LLAMA_PLAN, 0, 3)
    with pytest.raises(ValueError, match="KV heads"):
        P.Shard.of(llama_model(8).config.__class__(**{**vars(cfg), "n_kv_head": 4, "n_head": 12}),
                   P.LLAMA_PLAN, 0, 6)


def test_shards_put_back_together():
    m = llama_model(4)
    L = m.w.layers[0]
    world = 2
    shards = [P.shard_weights(m.w, P.LLAMA_PLAN, P.Shard.of(m.config, P.LLAMA_PLAN, r, world))
              for r in range(world)]
    D, Hq, Hk = 8, 8, 4
    q = torch.cat([s.layers[0].w_qkv[:, :Hq // world * D] for s in shards], dim=1)
    assert torch.equal(q, L.w_qkv[:, :Hq * D])
    assert torch.equal(torch.cat([s.layers[0].w_o for s in shards]), L.w_o)
    assert torch.equal(torch.cat([s.layers[0].w_gu[:, :48] for s in shards], dim=1), L.w_gu[:, :96])
    assert all(s.layers[0].b_o is L.b_o for s in shards)          # added once, after the all-reduce
    wte = torch.cat([s.wte for s in shards])                      # padded to 2 * 501 rows
    assert wte.shape[0] == 1002 and torch.equal(wte[:1001], m.w.wte) and not wte[1001:].any()
    head = torch.cat([s.lm_head for s in shards], dim=1)
    assert torch.equal(head[:, :1001], m.w.lm_head)


def test_refusals_name_the_argument():
    with pytest.raises(TypeError, match="group"):
        tensor_parallel(llama_model(), 2)
    with pytest.raises(TypeError, match="plan"):
        P.plan_for(object())
    with pytest.raises(ValueError, match="n:"):
        launch(0, rank_main)


# ---------------------------------------------------------------------------------------------------
# Rank 0 in this process (the engine's way): start() spawns the followers
# ---------------------------------------------------------------------------------------------------
def test_engine_on_a_started_group_and_a_killed_follower(reference):
    ref = reference["gpt2"]
    eng = Engine(reference["gpt2_model"], tensor_parallel=2, num_blocks=NUM_BLOCKS)
    leadership = eng.model.tp.leadership
    try:
        assert eng.runner.graphs is None and any("tensor parallel over 2" in n for n in eng.notes)
        ps = prompts(eng.model.vocab_size)
        assert [c.token_ids for c in eng.generate(ps, GREEDY)] == ref["tokens"]
        assert eng.pool.num_free == NUM_BLOCKS
        # a follower killed between steps: the next step fails its requests with the rank and exit code
        leadership.workers.kids.procs[1].kill()
        t0 = time.monotonic()
        req = eng.add_request(ps[1], GREEDY)
        with pytest.raises(RankFailed) as e:
            eng.run()
        assert time.monotonic() - t0 < 30
        assert e.value.rank == 1 and e.value.exitcode == -9, e.value.failures
        assert req.finish_reason == "error" and eng.pool.num_free == NUM_BLOCKS
        with pytest.raises(RuntimeError, match="unusable"):     # and it stays failed, fast
            eng.generate([ps[0]], GREEDY)
    finally:
        eng.close()
    eng.close()                                                 # (once is enough)


def test_engine_refuses_what_has_no_tensor_parallel_path(reference):
    m = reference["gpt2_model"]
    with pytest.raises(ValueError, match="tensor_parallel: not supported with quant"):
        Engine(m, tensor_parallel=2, quant="int8")
    with pytest.raises(ValueError, match="tensor_parallel: 3 ranks do not divide the 4 attention heads"):
        Engine(m, tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel: expected an int >= 1"):
        Engine(m, tensor_parallel=0)


def test_generate_cli_tp_flag(capsys):
    from tritune.harness.cli import main

    base = ["generate", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0", "--dtype", "fp32",
            "--backend", "torch"]
    assert main(base) == 0
    out = capsys.readouterr()[0]
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:   # one rank per GPU: refused before work
        assert main(base + ["--tp", "2"]) == 2
        assert "--tp: 2 ranks need 2 CUDA devices" in capsys.readouterr()[1]
    else:
        assert main(base + ["--tp", "2"]) == 0
        got, err = capsys.readouterr()
        assert got == out and "tp 2" in err
    assert main(base + ["--tp", "3"]) == 2
    assert "--tp: 3 ranks do not divide" in capsys.readouterr()[1]


def test_init_from_torchrun_variables(monkeypatch):
    from tritune.model.parallel import group as G

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE"):
        G.init_from_env()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    g = G.init_from_env("gloo")
    assert (g.rank, g.world_size) == (0, 1)
    x = torch.ones(3)
    assert g.all_reduce(x) is x and g.broadcast_object("meta") == "meta"
    with pytest.raises(ValueError, match="rank"):
        G.init(2, 2, "gloo", port=1)
    with pytest.raises(ValueError, match="backend"):
        G.init(2, 0, "mpi", port=1)


def complete_when_up(proc, port: int, what: str, bound_s: float = 90.0):
    """The openai client's greedy 8-token completion of "ROMEO:" from the server ``proc`` starts on ``port``,
    asked until it answers (``proc`` alive, within ``bound_s``)."""
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    t0 = time.time()
    while True:
        try:
            return c.completions.create(model="tritune-default", prompt="ROMEO:", max_tokens=8, temperature=0)
        except (openai.APIConnectionError, openai.APIStatusError):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() - t0 < bound_s, f"{what} did not come up in {bound_s:.0f} s"
            time.sleep(0.3)


@pytest.mark.skipif(default_model_dir() is None, reason="no packaged checkpoint (model/default/)")
def test_serve_tp_over_http_equals_one_rank():
    """``tritune serve --tp 2`` (the engine in its own process, leading a second rank over gloo) answers an
    OpenAI completion with one rank's greedy text, and Ctrl-C ends the server, its engine and that rank."""
    import signal
    import socket
    import subprocess
    import sys

    from tritune.model.tokenizer import Tokenizer

    model = GPT2.from_pretrained(default_model_dir(), backend="torch", dtype=torch.float32, device="cpu")
    tok = Tokenizer.from_dir(model.directory)
    eng = Engine(model, num_blocks=NUM_BLOCKS * 4, cuda_graphs=False, tokenizer=tok)
    want = eng.generate([tok.encode("ROMEO:")], [SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)])
    want_text = tok.decode(want[0].token_ids)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = "import sys; from tritune.harness.cli import main; sys.exit(main())"
    p = subprocess.Popen([sys.executable, "-c", cli, "serve", "--port", str(port), "--log-level", "warning", "--tp",
                          "2", "--engine", "process", "--backend", "torch", "--max-num-seqs", "4",
                          "--max-batch-tokens", "256", "--no-warm-up"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        r = complete_when_up(p, port, "tritune serve --tp 2")
        assert r.choices[0].text == want_text and r.usage.completion_tokens == 8
        p.send_signal(signal.SIGINT)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(20)


@pytest.mark.skipif(default_model_dir() is None, reason="no packaged checkpoint (model/default/)")
def test_generate_under_torchrun_equals_one_process():
    """``torchrun --nproc-per-node 2 -m tritune.harness.cli generate --tp 2``: every rank joins from torchrun's
    variables (no rank spawned by the engine), rank 0 prints one process's greedy text, rank 1 follows it."""
    import socket
    import subprocess
    import sys

    args = ["generate", "ROMEO:", "--backend", "torch", "--max-new-tokens", "12", "--temperature", "0"]
    one = subprocess.run([sys.executable, "-m", "tritune.harness.cli", *args], capture_output=True, text=True,
                         timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(port), "-m", "tritune.harness.cli", *args, "--tp", "2"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert two.stdout.strip() == one.stdout.strip(), (two.stdout, one.stdout)
    assert "tp 2" in two.stderr


@pytest.mark.skipif(default_model_dir() is None, reason="no packaged checkpoint (model/default/)")
def test_serve_under_torchrun_answers_from_rank_0():
    """``torchrun --nproc-per-node 2 -m tritune.harness.cli serve --tp 2``: rank 0 serves HTTP with its engine
    leading, rank 1 follows without a server; the completion is one process's greedy text; Ctrl-C ends all."""
    import signal
    import socket
    import subprocess
    import sys

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    one = subprocess.run([sys.executable, "-m", "tritune.harness.cli", "generate", "ROMEO:", "--backend", "torch",
                          "--max-new-tokens", "8", "--temperature", "0"], capture_output=True, text=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(ports[0]), "-m", "tritune.harness.cli", "serve", "--tp", "2",
                          "--port", str(ports[1]), "--backend", "torch", "--engine", "process", "--no-warm-up",
                          "--max-num-seqs", "4", "--max-batch-tokens", "256", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        r = complete_when_up(p, ports[1], "serve --tp 2 under torchrun")
        assert "ROMEO:" + r.choices[0].text == one.stdout.rstrip("\n")
        p.send_signal(signal.SIGINT)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(20)
