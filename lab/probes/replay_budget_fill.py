"""Probe (issue #23): what would the rest of a budgeted `tune all` run do, replayed on the CPU?

Resumes a committed run's storage (a copy) with ``tune_budget`` on this machine, with no GPU: the studies
are planned as the GPU's (its standard buckets, ``--slug``), and each trial is answered from a table
instead of a kernel launch, after a sleep of ``--trial-s`` seconds (a precompiled trial's time on the GPU,
scaled by ``--scale``; the remaining budget is scaled alike). A config the storage has timed gets its
recorded time; a config that is the committed store's entry for the bucket (``--what-if``) gets the
committed time; any other config is answered slower than the study's best (``--unseen``), so the replay
measures *reach*: does the search, in the time left, try the configs that a longer sweep found?

It runs the code of this checkout (phases, fill, resumed fill, runners-up) on the real storage, so it
also shows that a resume does not fail before a device minute is spent on it.

    python lab/probes/replay_budget_fill.py lab/logs/h200/tune_all_budget_precompile_2026-11-28_bf26655 \\
        --what-if tuning/configs/nvidia-h200 --scale 0.25 --watch gemm:M=1,N=2304,K=768,ln=1,kv=1
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a committed run's folder: h200-budget.journal.xz (or a journal file)")
    ap.add_argument("--slug", default="nvidia-h200")
    ap.add_argument("--dtype", action="append", default=None, help="the run's --dtype (default bf16)")
    ap.add_argument("--budget-min", type=float, default=30.0, help="the run's budget (default 30)")
    ap.add_argument("--scale", type=float, default=0.25, help="time scale of the replay (default 0.25)")
    ap.add_argument("--trial-s", type=float, default=0.3, help="a trial's seconds on the GPU (precompiled)")
    ap.add_argument("--unseen", type=float, default=1.3, help="an unseen config's time over the study's best")
    ap.add_argument("--what-if", default=None, help="a store folder whose entries a trial of theirs finds")
    ap.add_argument("--watch", action="append", default=[], help="KERNEL:BUCKET to report trial by trial")
    ap.add_argument("--out", default=None, help="JSON of the studies' bests before and after")
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ["bf16"]

    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["TRITUNE_GPU_SLUG"] = a.slug
    import optuna

    from tritune.harness import device as dev
    from tritune.tuning import budget as tb, search, store

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="replay-"))
    src = Path(a.run)
    journal = tmp / "replay.journal"
    if src.is_dir():
        with lzma.open(src / "h200-budget.journal.xz") as f, open(journal, "wb") as g:
            shutil.copyfileobj(f, g)
    else:
        shutil.copy(src, journal)
    storage = search.open_storage(str(journal))

    real_plan = search.plan

    def plan_as_gpu(specs, problems=None, dtypes=None, slug=None, log=None):   # the GPU's standard buckets
        real = dev.interpreted
        dev.interpreted = lambda: False
        try:
            return real_plan(specs, problems, dtypes, slug, log)
        finally:
            dev.interpreted = real
    search.plan = plan_as_gpu

    committed = {}
    if a.what_if:
        for f in Path(a.what_if).glob("*.json"):
            d = json.loads(f.read_text())
            for e in d.get("entries", []):
                committed[(d["kernel"], e["bucket"], e["dtype"])] = (e["config"], e["time_us"])

    recorded: dict[tuple, float] = {}
    best0: dict[str, float] = {}
    for name in optuna.get_all_study_names(storage):
        st = optuna.load_study(study_name=name, storage=storage)
        vals = [t.value for t in st.get_trials(deepcopy=False) if t.value is not None]
        if vals:
            best0[name] = min(vals)
        for t in st.get_trials(deepcopy=False):
            if t.value is not None:
                k = (name, json.dumps(t.params, sort_keys=True))
                recorded[k] = min(recorded.get(k, float("inf")), t.value)
    answers = {"recorded": 0, "what-if": 0, "unseen": 0}
    watched: dict[str, list] = {}

    def evaluate(task):
        time.sleep(a.trial_s * a.scale)
        spec = task.spec_or_lookup()
        jobs = [j for j in jobs_by_key.get((task.kernel, repr(task.problem), str(task.dtype)), [])]
        name = jobs[0].name if jobs else None
        cfg = dict(task.config)
        k = (name, json.dumps({p: cfg[p] for p in spec.space.params if p in cfg}, sort_keys=True))
        bucket = jobs[0].bucket if jobs else None
        c = committed.get((task.kernel, bucket, jobs[0].key if jobs else None))
        if k in recorded:
            us, how = recorded[k], "recorded"
        elif c is not None and all(cfg.get(p) == v for p, v in c[0].items()):
            us, how = c[1], "what-if"
        else:
            h = zlib.crc32(k[1].encode()) % 1000 / 1000.0   # a fixed spread, so ties do not decide
            us, how = best0.get(name, 100.0) * (a.unseen + 0.2 * h), "unseen"
        answers[how] += 1
        for w in a.watch:
            if name and name.startswith(w + ":"):
                watched.setdefault(w, []).append((how, round(us, 3), {p: cfg[p] for p in spec.space.params}))
        return {"ok": True, "ms": us / 1000.0}

    import torch
    specs = search.resolve_specs("all")
    dtypes = [getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(d, d)) for d in a.dtype]
    jobs = plan_as_gpu(specs, None, dtypes, a.slug)
    jobs_by_key: dict[tuple, list] = {}
    for j in jobs:
        jobs_by_key.setdefault((j.spec.name, repr(j.problem), str(j.dtype)), []).append(j)
    spent = sum(tb.ledger(optuna.load_study(study_name=j.name, storage=storage))["spent_s"]
                for j in jobs if j.name in best0)
    left = a.budget_min * 60 - spent
    budget_s = spent + left * a.scale
    print(f"replay: {len(jobs)} studies, {spent / 60:.1f} of {a.budget_min:.0f} min spent; the {left / 60:.1f} min "
          f"left replayed as {left * a.scale / 60:.1f} min (scale {a.scale}, {a.trial_s * a.scale:.3f} s a trial)")
    logs = []
    t0 = time.time()
    try:
        tb.tune_budget(specs, budget_s, storage=str(journal), slug=a.slug, evaluate=evaluate, dtypes=dtypes,
                                 isolation="inline", progress=False, precompile_helpers=0,
                                 log=lambda m: (logs.append(m), print(m)))
    finally:
        search.plan = real_plan
    print(f"replay: {time.time() - t0:.0f} s; answers {answers}")
    after = {}
    for j in jobs:
        st = optuna.load_study(study_name=j.name, storage=storage)
        vals = [t.value for t in st.get_trials(deepcopy=False) if t.value is not None]
        after[j.name] = {"before_us": best0.get(j.name), "after_us": min(vals) if vals else None,
                         "trials": len(vals), "stop": tb.ledger(st)["stop"]}
    gained = [(n, v) for n, v in after.items() if v["before_us"] and v["after_us"] and v["after_us"] < v["before_us"]]
    print(f"replay: {len(gained)} studies improved (all of it from committed configs the search reached)")
    for n, v in gained:
        print(f"  {n.split(':space')[0]}: {v['before_us']:.2f} -> {v['after_us']:.2f} us")
    for w, ts in watched.items():
        print(f"watched {w}: {len(ts)} trials")
        for how, us, cfg in ts:
            print(f"  {how:9s} {us:8.2f} us  {cfg}")
    if a.out:
        Path(a.out).write_text(json.dumps({"answers": answers, "studies": after, "log": logs}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
