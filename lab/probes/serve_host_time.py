"""Host time per token of the engine process of ``tritune serve`` against the same engine in-process, the
device stubbed (forward_step returns zero logits, graph replays do nothing, tokens fixed: only Python's
host work remains), under serve-bench's load (512 requests, prompts and outputs 64-512, 256 seats,
8192-token steps, decode_steps 16).

  python lab/probes/serve_host_time.py [REPS]

Three ways through the same workload, each timed by this process's CPU time (every thread: the engine
process's sender thread included) and wall time, per output token:
  bare       add_request without a stream, step until done (the engine's own host work)
  inprocess  with a stream callback that counts tokens (what lab/bench_http.py's in-process run does)
  server     the engine process's loop (serve_proc._Core): requests added as its pipe brings them, each
             step's news collected and sent through its sender thread over a real pipe to a process that
             reads and discards it (the API process's side is not counted)

Found on the CPU, 2026-11-24 (us/token CPU, best of 3): bare 2.31, inprocess 2.51; server 3.15 with the
per-token stream callback and per-request tuples (403501d), 2.64-2.69 with the step's tokens read from
output_ids and sent as arrays (26133e9).
"""
import multiprocessing as mp
import random
import sys
import time

import torch

from tritune.model import engine as E
from tritune.model import runner as R
from tritune.model import serve_proc as SP
from tritune.model import weights as W
from tritune.model.gpt2 import GPT2, GPT2Config
from tritune.model.graphs import DecodeGraphs
from tritune.model.scheduler import SamplingParams

V = 512


def stubbed_engine():
    cfg = GPT2Config(vocab_size=V, n_positions=1024, n_embd=32, n_layer=1, n_head=2)
    state = {k: torch.randn(v) * 0.1 for k, v in W.expected_shapes(cfg).items()}
    m = GPT2(cfg, W.to_layout(cfg, state, torch.float32, "cpu"), backend="torch")
    eng = E.Engine(m, num_blocks=56954, max_num_seqs=256, max_batch_tokens=8192, block_size=16, cuda_graphs=False)
    g = DecodeGraphs(m, eng.pool, 64, [1, 2, 4, 8, 16, 32, 64, 128, 256], hist=16, capture=False)

    class Stub(DecodeGraphs):
        def run(self, B, steps=1):
            return torch.zeros(B, V)

        def tokens(self, positions, steps):
            return [[(p + 1 + k) % (V - 1) + 1 for p in positions] for k in range(steps)]

    g.__class__ = Stub
    eng.runner.graphs = g

    def fwd(*a, logit_rows=None, **k):
        return torch.zeros(a[-3].shape[0] if logit_rows is None else logit_rows.shape[0], V)

    R.forward_step = fwd
    return eng


def _drain(conn):
    n = 0
    try:
        while True:
            n += len(conn.recv_bytes())
    except (EOFError, OSError):
        pass


def run(eng, items, how: str, core=None):
    sp = [SamplingParams(max_new_tokens=o, ignore_eos=True) for _, o in items]
    c0, t0 = time.process_time(), time.perf_counter()
    if how == "server":
        # the ids the API process sends: ints since the compact step message, strings before it
        ints = hasattr(SP, "ARRIVAL_STEPS")
        ops = [("add", k + 1 if ints else f"cmpl-{k:032x}-0", p, s) for k, ((p, _), s) in enumerate(zip(items, sp))]
        for op in ops:
            core._op(op)
        while eng.has_unfinished():
            core.step_once()
            core._flush()
        core.out.put(("sync",))
    else:
        counts = [0] * len(items)

        def cb(i, req, tok):
            if tok is not None:
                counts[i] += 1

        for i, ((p, _), s) in enumerate(zip(items, sp)):
            eng.add_request(p, s, stream=None if how == "bare" else (lambda req, tok, i=i: cb(i, req, tok)))
        while eng.has_unfinished():
            eng.step()
    return time.process_time() - c0, time.perf_counter() - t0


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(1)
    eng = stubbed_engine()
    rng = random.Random(0)
    items = [([rng.randrange(1, V) for _ in range(rng.randint(64, 512))], rng.randint(64, 512)) for _ in range(512)]
    out_tokens = sum(o for _, o in items)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    reader = ctx.Process(target=_drain, args=(b,), daemon=True)
    reader.start()
    b.close()
    sender = SP._Sender(a, "probe-send")
    core = SP._Core(eng, None, sender)
    for how in ("bare", "inprocess", "server"):
        run(eng, items[:64], how, core)     # warm
    best = {}
    for _ in range(reps):
        for how in ("bare", "inprocess", "server"):
            cpu, wall = run(eng, items, how, core)
            b_cpu, b_wall = best.get(how, (1e9, 1e9))
            best[how] = (min(cpu, b_cpu), min(wall, b_wall))
    sender.close()
    a.close()
    reader.join(5)
    print(f"{out_tokens} output tokens, best of {reps}; us per output token (CPU of every thread / wall):")
    for how, (cpu, wall) in best.items():
        print(f"  {how:9s} {cpu / out_tokens * 1e6:6.2f} / {wall / out_tokens * 1e6:6.2f}")
    cpu_i, cpu_s = best["inprocess"][0], best["server"][0]
    print(f"  server - inprocess: {(cpu_s - cpu_i) / out_tokens * 1e6:+.2f} us/token CPU")


if __name__ == "__main__":
    main()
