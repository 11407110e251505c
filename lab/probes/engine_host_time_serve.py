"""Host time of Engine.step under a serve-bench-like load (512 requests, prompts/outputs 64-512, 256 seats,
8192-token steps), device stubbed: forward_step returns zero logits, graph replays do nothing, tokens fixed.
Run against the installed tree: `python lab/probes/engine_host_time_serve.py`, and with PYTHONPATH at an install of
an older tree to compare (b75c3a1: 350 ms a run, HEAD fb45dbc: 366 ms; +5%, all in schedule(); with the
schedule() fast path for decodes, 2026-11-24: b75c3a1 322-325 ms, schedule 129 ms; new 301-304 ms, schedule 103-105 ms)."""
import sys, time, random, functools, statistics
import torch
from tritune.model import engine as E
from tritune.model.gpt2 import GPT2, GPT2Config
from tritune.model.scheduler import SamplingParams
try:
    from tritune.model import runner as R
    from tritune.model.graphs import DecodeGraphs as G
    NEW = True
except ImportError:
    R = E; G = E.DecodeGraphs; NEW = False
V = 512
cfg = GPT2Config(vocab_size=V, n_positions=1024, n_embd=32, n_layer=1, n_head=2)
from tritune.model import weights as W
E_, Fd = 32, 128
shp = {"wte.weight": (V, E_), "wpe.weight": (1024, E_), "ln_f.weight": (E_,), "ln_f.bias": (E_,)}
for nm, sh in (("ln_1.weight", (E_,)), ("ln_1.bias", (E_,)), ("attn.c_attn.weight", (E_, 3 * E_)), ("attn.c_attn.bias", (3 * E_,)),
               ("attn.c_proj.weight", (E_, E_)), ("attn.c_proj.bias", (E_,)), ("ln_2.weight", (E_,)), ("ln_2.bias", (E_,)),
               ("mlp.c_fc.weight", (E_, Fd)), ("mlp.c_fc.bias", (Fd,)), ("mlp.c_proj.weight", (Fd, E_)), ("mlp.c_proj.bias", (E_,))):
    shp["h.0." + nm] = sh
state = {k: torch.randn(v) * 0.1 for k, v in shp.items()}
m = GPT2(cfg, W.to_layout(cfg, state, torch.float32, "cpu"), backend="torch")
eng = E.Engine(m, num_blocks=56954, max_num_seqs=256, max_batch_tokens=8192, block_size=16, cuda_graphs=False)
buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
if NEW:
    g = G(m, eng.pool, 64, buckets, hist=16, capture=False)
else:
    g = G(eng.model, eng.ops, eng.pool, 64, buckets, hist=16, capture=False)
class Stub(G):
    def run(self, B, steps=1): return torch.zeros(B, V)
    def tokens(self, positions, steps): return [[(p + 1 + k) % (V - 1) + 1 for p in positions] for k in range(steps)]
g.__class__ = Stub
if NEW: eng.runner.graphs = g
else: eng.graphs = g
def fwd(*a, logit_rows=None, **k):
    n = a[-3].shape[0] if logit_rows is None else logit_rows.shape[0]
    return torch.zeros(n, V)
R.forward_step = fwd
rng = random.Random(0)
items = [([rng.randrange(1, V) for _ in range(rng.randint(64, 512))], rng.randint(64, 512)) for _ in range(512)]
acc = {}
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[label] = acc.get(label, 0) + time.perf_counter() - t; return r
    setattr(obj, name, w)
sch = eng.scheduler
wrap(sch, "schedule", "schedule"); wrap(sch, "update_steps", "update_steps"); wrap(sch, "update", "update")
for n in ("_graph_launch", "_graph_land", "_graph_decode", "_forward", "_eager", "_retire", "_sample", "sampler"):
    if hasattr(eng, n) and n != "sampler": wrap(eng, n, n)
if NEW: wrap(eng.runner, "eager", "eager"); wrap(eng.runner, "forward", "forward")
wrap(g, "load", "load"); wrap(g, "tokens", "tokens")
def once():
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=o, ignore_eos=True)) for p, o in items]
    s0 = eng.stats["steps"]; n = 0
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step(); n += 1
    T = time.perf_counter() - t0
    return T, n, eng.stats["steps"] - s0, sum(len(r.output_ids) for r in reqs)
once()
acc.clear(); eng.timings.update({k: 0.0 for k in eng.timings if k.endswith("_s")})
res = []
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    res.append(once())
T, n, steps, out = min(res)
reps = len(res)
print(f"{'new' if NEW else 'old'} {E.__file__}\n  step() calls {n}, engine steps {steps}, out tokens {out}: "
      f"host {T*1e3:.0f} ms/run = {T/n*1e6:.0f} us per step() call, {T/out*1e6:.2f} us per output token")
print("  parts ms/run:", {k: round(v / reps * 1e3, 1) for k, v in sorted(acc.items())})
print("  timings ms/run:", {k: round(v / reps * 1e3, 1) for k, v in eng.timings.items() if k.endswith("_s")})
if len(sys.argv) > 2:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable(); once(); pr.disable()
    pstats.Stats(pr).sort_stats(sys.argv[2]).print_stats(35)
