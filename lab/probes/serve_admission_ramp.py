"""The engine process's admission ramp without HTTP: 512 requests submitted to an EngineProcess (the stub
engine: tokens at 55000/s, 16 a request a step, 256 seats) spread evenly over 200 ms, as an H100 serve run's
HTTP handlers submitted them; submit -> add_request in the engine process (p50 / max), for decode runs of
``decode_steps`` while requests arrive (off) and of ARRIVAL_STEPS (on).

  python lab/probes/serve_admission_ramp.py [SPREAD_MS]

Found on the CPU, 2026-11-24: off p50 26 ms, max 75 ms; 2-step runs p50 6.5 ms, max 38 ms. Over HTTP
(lab/bench_http.py --stub --modes process --skip-clients) the p50 was 63-70 ms with or without short runs
until the API process stopped queueing its adds with call_soon (they waited behind every handler of the
burst); after both: p50 5-7 ms (max 20-146 ms: this machine's 2 shared cores).
"""
import asyncio
import sys
import time

from tritune.model.scheduler import SamplingParams
from tritune.model.serve_proc import ARRIVAL_STEPS, EngineProcess
from tritune.model.server import Seq


async def ramp(ep: EngineProcess, n: int, spread_s: float, out_len: int) -> dict:
    ep.start(asyncio.get_running_loop())
    sink: asyncio.Queue = asyncio.Queue()
    t0 = time.perf_counter()
    seqs = []
    for i in range(n):
        now = time.perf_counter()
        due = t0 + spread_s * i / n
        if due > now:
            await asyncio.sleep(due - now)
        seq = Seq(f"r{i}", i, sink, time.perf_counter())
        seqs.append(seq)
        ep.submit([(seq, [1 + i % 500] * 64, SamplingParams(max_new_tokens=out_len, ignore_eos=True))])
    ended = 0
    while ended < n:
        ended += (await sink.get())[3] is not None
    adds = dict(await ep.admission_trace())
    sub = sorted(adds[wid] - s for wid, _, s in ep.trace if wid in adds)
    stats = await ep.stats()
    return {"p50_ms": round(1e3 * sub[len(sub) // 2], 1), "max_ms": round(1e3 * sub[-1], 1),
            "short_runs": stats["short_runs"], "steps": stats["steps"],
            "elapsed_s": round(time.perf_counter() - t0, 2)}


def main():
    spread = float(sys.argv[1]) / 1e3 if len(sys.argv) > 1 else 0.2
    for steps in (0, ARRIVAL_STEPS):
        ep = EngineProcess("tritune.model.serve_proc:stub_engine",
                           dict(rate=55000.0, decode_steps=16, max_num_seqs=256), arrival_steps=steps or None)
        try:
            res = asyncio.run(ramp(ep, 512, spread, 256))
        finally:
            ep.stop()
        print(f"arrival_steps {steps or 'off'}: submit -> add p50 {res['p50_ms']} ms, max {res['max_ms']} ms; "
              f"{res['short_runs']} short runs of {res['steps']} steps; all done in {res['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
