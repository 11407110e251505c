"""A new GPU type in one command: ``tritune tune all --budget 30m``.

Every kernel's standard buckets are tuned within a wall-clock budget: each study gets an equal share of
what is left (a study that ends early, its space exhausted, leaves its time to the next), and starts from

1. the heuristic default (the baseline),
2. this GPU's own stored entry, if any,
3. the nearest GPU type's stored winners (``warm``): for the same bucket and dtype key, then for the
   nearest neighbouring buckets. Nearest: the same vendor, then the same family letter (h100, h200,
   h20: ``h``), then the closest model number (an H200 warm-starts from the H100).

Then the front runners of each study (the tuned best, the best warm seed, the default) are re-timed side
by side, in interleaved rounds with the order rotated each round, in one worker process: the winner is
the lowest median over the rounds, so a config that was lucky once in the sweep does not win on noise.
The re-timing is stored on the study (``retimed``) and the export takes its winner and times.
"""
from __future__ import annotations

import math
import re
import statistics
import sys
import time

from tritune.tuning import search, store

RETIME_ROUNDS = 5
RETIME_SHARE = 0.1   # of the budget, kept for re-timing


def _model(slug: str) -> tuple[str, str, float | None]:
    """(vendor, family letters, model number) of a GPU slug: 'nvidia-h100-80gb-hbm3' -> ('nvidia', 'h', 100)."""
    parts = slug.lower().split("-")
    vendor = parts[0] if parts else ""
    for p in parts[1:]:
        m = re.fullmatch(r"([a-z]+)(\d+)[a-z]*", p)
        if m and m.group(1) not in ("gb", "hbm"):
            return vendor, m.group(1), float(m.group(2))
    return vendor, "", None


def nearest_slug(slug: str, available) -> str | None:
    """The stored GPU type nearest to ``slug``; None when none is of the same vendor."""
    v, fam, num = _model(slug)

    def score(other):
        ov, ofam, onum = _model(other)
        close = -abs(math.log(onum / num)) if (num and onum) else -99.0
        prefix = len([1 for a, b in zip(slug, other) if a == b])
        return (ofam == fam, close, prefix)

    cands = [s for s in available if s != slug and _model(s)[0] == v and v]
    return max(cands, key=score) if cands else None


def warm_configs(job, slug: str, limit: int = 3) -> list[dict]:
    """Another GPU type's stored winners for a job: its entry for the same bucket and dtype key, then
    those of the nearest buckets (at most ``limit`` distinct configs, invalid ones dropped)."""
    es = [e for e in store.entries(job.spec, slug) if e["dtype"] == job.key]
    want = store.parse_bucket(job.bucket)
    es.sort(key=lambda e: (store.bucket_distance(want, store.parse_bucket(e["bucket"])), e["bucket"]))
    out = []
    for e in es:
        cfg = dict(e["config"])
        if cfg not in out and not job.spec.space.why_invalid(cfg, job.problem, job.dtype):
            out.append(cfg)
        if len(out) >= limit:
            break
    return out


def front_runners(study) -> dict[str, tuple[dict, float]]:
    """role -> (config, sweep time µs) of the configs worth re-timing: the tuned best, the fastest warm
    or seeded config, the default (each only if it completed on the current code)."""
    from optuna.trial import TrialState

    st = search.study_stats(study)
    ts = search.current_trials(study.get_trials(deepcopy=False), search.code_version(st["kernel"]))
    done = [t for t in ts if t.state == TrialState.COMPLETE and t.value is not None]
    out = {}
    if st["config"] is not None:
        out["tuned"] = (st["config"], st["best_us"])
    seeds = [t for t in done if any(t.user_attrs.get(k) for k in ("warm", "previous", "seeded"))]
    if seeds:
        t = min(seeds, key=lambda t: t.value)
        out["seed"] = (dict(t.params), t.value)
    if st["default_us"] is not None:
        out["default"] = (st["default_config"], st["default_us"])
    return out


def retime(study, job, runner, rounds: int = RETIME_ROUNDS) -> dict | None:
    """Time the front runners side by side in ``rounds`` interleaved rounds (the order rotated each round);
    store and return {"winner", "config", "time_us", "default_us", "times_us", "rounds", "best_trial"}."""
    cands: dict[str, tuple[dict, list]] = {}   # first role of each distinct config -> (config, times)
    alias: dict[str, str] = {}                  # every role -> the role its config is timed under
    for role, (cfg, _) in front_runners(study).items():
        same = next((r for r, (c, _) in cands.items() if c == cfg), None)
        if same is None:
            cands[role] = (cfg, [])
        alias[role] = same or role
    if not cands:
        return None
    roles = list(cands)
    for r in range(rounds):
        for role in roles[r % len(roles):] + roles[:r % len(roles)]:
            cfg, times = cands[role]
            res = runner(search.Task(job.spec.name, job.problem, job.dtype, cfg, 0, spec=job.spec, verify=False))
            if res.get("ok"):
                times.append(float(res["ms"]) * 1e3)
    med = {role: statistics.median(ts) for role, (_, ts) in cands.items() if ts}
    if not med:
        return None
    winner = min(med, key=med.get)
    times_us = {role: round(med[a], 3) for role, a in alias.items() if a in med}
    out = {"winner": "+".join(r for r, a in alias.items() if a == winner), "config": cands[winner][0],
           "time_us": round(med[winner], 3), "default_us": times_us.get("default"),
           "times_us": times_us, "rounds": rounds, "best_trial": search.study_stats(study)["best_trial"]}
    study.set_user_attr("retimed", out)
    return out


def tune_budget(kernels_, budget_s: float, *, storage=None, trials: int | None = None, dtypes=None, problems=None,
                warm_from: str | None = None, rounds: int = RETIME_ROUNDS, progress: bool = True,
                slug: str | None = None, evaluate=None, isolation: str = "auto", timeout: float = search.TASK_TIMEOUT,
                seed: int = 0, log=None) -> tuple[list[dict], str | None]:
    """Tune within ``budget_s`` seconds, warm-started from ``warm_from`` (default: the nearest stored GPU
    type), then re-time each study's front runners. Returns (rows, the GPU type warmed from); each row
    is the study's stats plus ``seed_us`` and ``retimed``."""
    import optuna

    from tritune.harness import device as dev

    log = log or (lambda m: print(m, file=sys.stderr))
    slug = slug or dev.gpu_slug()
    t_end = time.time() + budget_s
    near = warm_from or nearest_slug(slug, store.slugs())
    log(f"tune: budget {budget_s / 60:.1f} min; warm start from "
        f"{near + ' (stored winners seeded as first trials)' if near else 'nothing (no stored GPU type of this vendor)'}")
    warm = (lambda job: warm_configs(job, near)) if near else None
    rows = search.tune(kernels_, problems, dtypes, trials=trials if trials is not None else 10**9, storage=storage,
                       time_budget=budget_s * (1 - RETIME_SHARE), seed=seed, evaluate=evaluate, isolation=isolation,
                       timeout=timeout, progress=progress, slug=slug, warm=warm, log=log)
    storage_obj = search.open_storage(storage)
    jobs = {j.name: j for j in search.plan(search.resolve_specs(kernels_), problems, dtypes, slug)}
    runner = search.make_runner(evaluate, isolation, timeout=timeout)
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm.auto import tqdm

        bar = tqdm(total=len(rows), desc="re-timing front runners", unit="study", file=sys.stderr, dynamic_ncols=True)
    try:
        for row in rows:
            job = jobs.get(row["study"])
            if job is None or row.get("config") is None:
                continue
            study = optuna.load_study(study_name=row["study"], storage=storage_obj)
            fr = front_runners(study)
            row["seed_us"] = fr["seed"][1] if "seed" in fr else None
            if time.time() < t_end:
                row["retimed"] = retime(study, job, runner, rounds)
            else:
                log(f"tune: {job.label()}: budget spent; not re-timed (the sweep's best is exported)")
            if bar is not None:
                bar.update(1)
    finally:
        runner.close()
        if bar is not None:
            bar.close()
    return rows, near


def summary_table(rows: list[dict]) -> str:
    from tabulate import tabulate

    from tritune.harness.report import _fmt

    table = []
    for r in rows:
        rt = r.get("retimed") or {}
        t = rt.get("times_us", {})
        win_us, def_us = rt.get("time_us", r.get("best_us")), rt.get("default_us", r.get("default_us"))
        table.append([r.get("kernel"), r.get("bucket"), r.get("dtype"), r.get("trials", 0), r.get("failed", 0),
                      _fmt(t.get("default", r.get("default_us"))), _fmt(t.get("seed", r.get("seed_us"))),
                      _fmt(t.get("tuned", r.get("best_us"))), rt.get("winner", "tuned (not re-timed)" if r.get("config") else "-"),
                      f"{def_us / win_us:.2f}x" if win_us and def_us else ""])
    head = ["kernel", "bucket", "dtype", "trials", "failed", "default µs", "warm seed µs", "tuned µs", "winner",
            "vs default"]
    sp = [r["retimed"]["default_us"] / r["retimed"]["time_us"] for r in rows
          if (r.get("retimed") or {}).get("default_us") and r["retimed"].get("time_us")]
    text = tabulate(table, headers=head, disable_numparse=True)
    if sp:
        g = math.exp(sum(map(math.log, sp)) / len(sp))
        text += f"\ngeomean of the winners over the default (re-timed side by side): {g:.3f}x over {len(sp)} studies"
    return text
