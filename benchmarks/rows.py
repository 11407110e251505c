"""Keyed result rows for the benchmark scripts: one JSON file per workload under ``results/<gpu-slug>/``.

``write_rows(what, rows)`` stamps every row with its key (``what``: the kernel or workload; ``gpu`` and
``gpu_slug``; ``date``; ``commit``; the ``torch`` and ``triton`` versions) and appends them to
``results/<gpu-slug>/<what>.json``'s ``records``, so runs at different commits sit side by side and can be
told apart. Fields passed as keywords (a summary, a command line) become the file's top-level fields,
replaced by each run, beside the same key fields of the latest run.

The commit is ``$TRITUNE_COMMIT`` when set (a copy of the tree on a GPU machine may carry a stale ``.git``),
else ``git rev-parse --short HEAD`` in this checkout. ``tritune report`` renders only the files it knows
(kernel ``rows``, ``decode.json``, ``serve.json``): a ``records`` file is data for a person, not a table.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    from tritune.tuning.timing import source_commit

    return (source_commit() or "unknown")[:7]


def gpu() -> tuple[str, str]:
    """(GPU name, slug): tritune's own slug where the package imports (``TRITUNE_GPU_SLUG`` overrides)."""
    try:
        from tritune.kernels.runtime import device

        return device.gpu_name(), device.gpu_slug()
    except Exception:  # noqa: BLE001  (no tritune: the same slug rule from torch's device name)
        name = "triton-interpreter"
        try:
            import torch

            if torch.cuda.is_available():
                name = torch.cuda.get_device_name()
        except ImportError:
            pass
        slug = os.environ.get("TRITUNE_GPU_SLUG") or re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        return name, slug


def versions() -> dict:
    out = {}
    for mod in ("torch", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def key(what: str, slug: str | None = None) -> dict:
    name, here = gpu()
    if slug and slug != here:       # rows measured elsewhere (a journal from another GPU): its slug, no name
        name = None
    slug = slug or here
    return {"what": what, "gpu": name, "gpu_slug": slug, "date": datetime.date.today().isoformat(),
            "commit": commit(), **versions()}


def write_rows(what: str, rows: list[dict], results_dir: str | Path = "results", *, slug: str | None = None,
               **fields) -> Path:
    """Append ``rows``, each stamped with the run's key, to ``<results_dir>/<gpu-slug>/<what>.json``;
    ``fields`` become the file's top-level fields (the key's own names stay the key's). ``slug``: the GPU the
    rows were measured on, where that is not this machine's. Returns the path written."""
    k = key(what, slug)
    path = Path(results_dir) / k["gpu_slug"] / f"{what}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    if path.is_file():
        try:
            old = json.loads(path.read_text())
            records = old.get("records", []) if isinstance(old, dict) else []
        except (OSError, ValueError):
            records = []
    records += [{**k, **r} for r in rows]
    doc = {**k, **{f: v for f, v in fields.items() if f not in k}, "records": records}
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path
