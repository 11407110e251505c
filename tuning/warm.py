"""Warm starts for a new GPU type: the nearest stored GPU type (the same vendor, then the same family
letter: h100, h200, h20 are ``h``; then the closest model number) and its stored winners for a study."""
from __future__ import annotations

import math
import re

from tritune.kernels.runtime import store


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
