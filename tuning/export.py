"""Export: the studies' winners into the store (``<root>/<slug>/<kernel>.json``, the store's format): per
bucket and dtype the best verified config (the re-timing's winner where it is current), its time, the
default's, trials used and failed."""
from __future__ import annotations

import collections
from pathlib import Path

from tritune.tuning.study import open_storage, study_stats, tuned_studies


def export(storage=None, kernels_=None, slug: str | None = None, root: Path | str | None = None,
           log=print) -> list[Path]:
    """Write ``<root>/<slug>/<kernel>.json`` (store format) from the studies: per bucket and dtype the
    best verified config, its time, the default's time, trials used and failed."""
    from tritune import kernels
    from tritune.kernels.runtime import device as dev
    from tritune.kernels.runtime import store

    storage = open_storage(storage)
    slug = slug or dev.gpu_slug()
    names = None if kernels_ in (None, "all", ["all"]) else [getattr(k, "name", k) for k in
                                                            ([kernels_] if isinstance(kernels_, str) else kernels_)]
    by_kernel: dict[str, list] = collections.defaultdict(list)
    for st in tuned_studies(storage, slug=slug):
        a = st.user_attrs
        if names is not None and a["kernel"] not in names:
            continue
        s = study_stats(st)
        if s["config"] is None:
            log(f"export: {st.study_name}: no verified trial; nothing to store")
            continue
        try:
            spec = kernels.get(a["kernel"])
            if set(s["config"]) != set(spec.space.params):
                log(f"export: {st.study_name}: best config {s['config']} no longer matches the space; skipped")
                continue
        except KeyError:
            pass
        config, best_us, default_us = s["config"], s["best_us"], s["default_us"]
        r = a.get("retimed")  # the side-by-side re-timing of the front runners decides, where it is current
        retimed = isinstance(r, dict) and r.get("best_trial") == s["best_trial"] and r.get("config")
        if retimed:
            config, best_us, default_us = r["config"], r["time_us"], r.get("default_us", default_us)
        e = {"bucket": a["bucket"], "dtype": a["dtype"], "config": config, "time_us": round(best_us, 3),
             "default_us": None if default_us is None else round(default_us, 3),
             "default_config": s["default_config"],
             "speedup": None if not default_us else round(default_us / best_us, 4),
             "trials": s["trials"], "failed": s["failed"], "problem": s["problem"],
             "problem_fields": s["problem_fields"], "study": st.study_name}
        if retimed:
            e["retimed"] = {k: r[k] for k in ("winner", "times_us", "rounds") if k in r}
        by_kernel[a["kernel"]].append(e)
    paths = []
    for k, entries in sorted(by_kernel.items()):
        p = store.write(k, entries, slug=slug, root=Path(root) if root is not None else None)
        log(f"export: wrote {p} ({len(entries)} entries)")
        paths.append(p)
    return paths
