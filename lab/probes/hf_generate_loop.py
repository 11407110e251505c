"""Why a patched HF GPT-2's compiled generate could be slower a step than HF's while its compiled call is not:
each hypothesis checked on the CPU by a count, not a time (transformers' static-cache compile recipe through
inductor, stubbed launchers, a tiny 12-layer GPT-2).

    python lab/probes/hf_generate_loop.py [--batch 32] [--new 24] [--layers 12]

Per variant (hf, tritune), over 3 generates after a warm-up: the logits' shape and dtype at the prefill and
at a decode step (logits_to_keep honoured?), the cache's class, its addresses across generates (the CPU's
allocator, not a GPU's) and whether its tensors outlive their generate without a gc pass (they would keep
a GPU's next cache off their addresses: a CUDA-graph re-recording), dynamo's counters (recompiles,
frames, graphs), the compiled calls against the decode steps, and the Python calls a decode step makes
outside the prefill and the compiled call (generate's own loop, from cProfile).
Found (2026-11-24, CPU, torch 2.13, transformers 5.24, batch 32, 12 layers): hf and tritune alike: logits
(32, 1, V) float32 at prefill and decode, StaticCache (a new one each generate), its tensors freed with
their generate, one compiled call a decode step, no dynamo counter moving, 858 Python calls a step.
"""
from __future__ import annotations

import argparse
import cProfile
import copy
import os
import pstats
import sys
import weakref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_hf_patch as B  # noqa: E402  (the driver's model, variants and stubs)
import torch  # noqa: E402


def probe(model, batch: int, new: int) -> dict:
    ids = torch.randint(1, B.VOCAB, (batch, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    shapes, ptrs, caches, refs = [], [], [], []
    fwd = model.forward

    def spy(*a, **k):  # the prefill's forward (eager): its logits as generate gets them
        out = fwd(*a, **k)
        shapes.append(("prefill", tuple(out.logits.shape), str(out.logits.dtype)))
        return out

    model.generate(ids, **kw)  # warm-up: compiles
    compiled = model._compiled_call
    st = {"calls": 0}
    prof = cProfile.Profile()

    def ccall(*a, **k):
        prof.disable()
        out = compiled(*a, **k)
        st["calls"] += 1
        if st["calls"] == 1:
            shapes.append(("decode", tuple(out.logits.shape), str(out.logits.dtype)))
        cache = k.get("past_key_values", k.get("cache"))
        caches.append(type(cache).__name__)
        lay = cache.layers[0]
        ptrs.append(lay.keys.data_ptr())
        refs[:] = [weakref.ref(t) for lay in cache.layers for t in (lay.keys, lay.values, lay.cumulative_length)]
        prof.enable()
        return out

    model._compiled_call = ccall
    prefill = model._prefill

    def pf(*a, **k):
        prof.disable()
        model.forward = spy
        try:
            return prefill(*a, **k)
        finally:
            del model.forward
            prof.enable()

    model._prefill = pf
    c0 = B._counters()
    alive = []
    for _ in range(3):
        prof.enable()
        model.generate(ids, **kw)
        prof.disable()
        # without a gc pass, as a GPU's caching allocator sees it: a cache still referenced when the next
        # generate allocates its own cannot give it the same addresses (static graph inputs: a re-recording)
        alive.append(sum(r() is not None for r in refs))
    del model._prefill
    model._compiled_call = compiled
    calls = sum(nc for (_, nc, _, _, _) in pstats.Stats(prof).stats.values())
    return {"logits": sorted(set(shapes)), "cache": sorted(set(caches)), "cache_addresses": len(set(ptrs)),
            "cache_tensors_alive_after_each_generate": alive,
            "compiled_calls": st["calls"], "decode_steps": 3 * (new - 1),
            "loop_python_calls_per_step": calls / (3 * (new - 1)), "dynamo": B._counter_diff(c0, B._counters())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    B.SMOKE.update(on=True, backend="inductor")
    B.SMOKE["config"]["n_layer"] = args.layers
    B.VOCAB = B.SMOKE["config"]["vocab_size"]
    B.stub_kernels()
    base = B._model()
    for name, patched in (("hf", False), ("tritune", True)):
        torch._dynamo.reset()
        r = probe(B._variant(copy.deepcopy(base), patched, True), args.batch, args.new)
        print(name, r, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
