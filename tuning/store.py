"""Tuned configs per GPU type: ``tuning/configs/<gpu-slug>/<kernel>.json``.

A file holds, for each (bucket, dtype), the winning config, its median time, the default config's
time, the trials it took, and the date, triton and torch versions of the sweep. Files are validated on
load: a malformed file, or one written for another kernel or GPU, is skipped with a warning naming it,
never a crash and never a config for the wrong kernel.

Lookup: exact bucket, else the nearest neighbouring bucket of the same dtype (log-distance over the
numeric fields, each within 4x; non-numeric fields must match), else ``None`` (the caller uses the
heuristic default). Entries tuned against other code of the kernel (stale) are skipped. Files are read
once per process; launchers cache the result per (kernel, bucket, dtype), so the hot path does no I/O.
"""
from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path

import torch

from tritune.harness import device as dev

PACKAGE_CONFIGS = Path(__file__).resolve().parent / "configs"
FORMAT = 1


def config_root() -> Path:
    """``TRITUNE_CONFIGS`` (a directory holding ``<slug>/<kernel>.json``) overrides the packaged store."""
    return Path(os.environ.get("TRITUNE_CONFIGS", PACKAGE_CONFIGS))


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_bucket(key: str) -> dict:
    out = {}
    for part in key.split(","):
        if not part:
            continue
        k, _, v = part.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = v
    return out


def bucket_distance(a: dict, b: dict) -> float:
    """Sum over numeric fields of |log2 a - log2 b|; inf when the keys or a non-numeric field differ, or
    when one numeric field is more than MAX_FIELD_LOG2 away."""
    if set(a) != set(b):
        return math.inf
    d = 0.0
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0:
            f = abs(math.log2(x) - math.log2(y))
            if f > MAX_FIELD_LOG2:
                return math.inf
            d += f
        elif x != y:
            return math.inf
    return d


class StoreError(ValueError):
    pass


def validate(data, kernel: str, slug: str | None = None) -> list[dict]:
    """The entries of a store file, or StoreError saying what is wrong with it."""
    if not isinstance(data, dict):
        raise StoreError("top level is not an object")
    if data.get("kernel") != kernel:
        raise StoreError(f"written for kernel {data.get('kernel')!r}, not {kernel!r}")
    if slug is not None and data.get("gpu") != slug:
        raise StoreError(f"written for GPU {data.get('gpu')!r}, not {slug!r}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise StoreError("'entries' is not a list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise StoreError(f"entry {i} is not an object")
        for k, typ in (("bucket", str), ("dtype", str), ("config", dict)):
            if not isinstance(e.get(k), typ):
                raise StoreError(f"entry {i}: {k!r} missing or not a {typ.__name__}")
        if not all(isinstance(v, (int, float, str, bool)) for v in e["config"].values()):
            raise StoreError(f"entry {i}: config values must be scalars")
    return entries


@functools.lru_cache(maxsize=None)
def source_hash(kernel: str) -> str | None:
    """sha256 (12 hex digits) of the source of the ``@triton.jit`` functions in the kernel's module: an
    entry records the code it was timed on, so a config tuned for another version of the kernel is known
    as stale. Only the jitted code counts (not the launcher's docstrings or validation), so editing the
    Python around a kernel does not throw its tuned configs away."""
    import hashlib
    import inspect
    import sys

    from tritune import kernels

    try:
        mod = sys.modules[kernels.get(kernel).run.__module__]
    except (KeyError, AttributeError):
        return None
    srcs = []
    for name, obj in sorted(vars(mod).items()):
        fn = getattr(obj, "fn", None)  # triton's JITFunction (and the interpreter's wrapper) keep the function
        if callable(fn) and type(obj).__module__.startswith("triton") and getattr(fn, "__module__", None) == mod.__name__:
            try:
                srcs.append(f"{name}\n{inspect.getsource(fn)}")
            except (OSError, TypeError):
                return None
    if not srcs:
        return None
    return hashlib.sha256("\n".join(srcs).encode()).hexdigest()[:12]


def stale(kernel: str, es) -> list[dict]:
    """Entries tuned against another version of the kernel's jitted code (entries that record none are
    not judged). Lookup skips them: a config timed on other code is neither verified nor known fast
    (a gemm sweep found such entries 1.1-13x slower than the current defaults)."""
    h = source_hash(kernel)
    return [e for e in es if h is not None and e.get("source") not in (None, h)]


def path_for(kernel: str, slug: str | None = None, root: Path | None = None) -> Path:
    return (root or config_root()) / (slug or dev.gpu_slug()) / f"{kernel}.json"


@functools.lru_cache(maxsize=None)
def _load(path: str, kernel: str, slug: str) -> tuple:
    p = Path(path)
    if not p.exists():
        return ()
    try:
        data = json.loads(p.read_text())
        es = tuple(validate(data, kernel, slug))
    except (OSError, ValueError) as e:
        warnings.warn(f"tritune: ignoring tuned-config file {p}: {e}; using heuristic defaults", stacklevel=3)
        return ()
    old = stale(kernel, es)
    if old:  # still valid points of the space (checked at lookup), but timed on other code: say so once
        warnings.warn(f"tritune: {len(old)} of {len(es)} entries in {p} were tuned against another version of "
                      f"the {kernel} kernel; they are skipped (heuristic defaults instead): re-run "
                      f"`tritune tune {kernel}` to refresh them",
                      stacklevel=3)
    return es


def entries(kernel: str, slug: str | None = None) -> tuple:
    slug = slug or dev.gpu_slug()
    return _load(str(path_for(kernel, slug)), kernel, slug)


# Nearest-bucket fallback only between neighbours: each numeric field within a factor of 4, and at most
# three octaves in all. A config tuned at M=1 says nothing about M=8192 (it handed 8192^3 a 32x16 tile).
MAX_FIELD_LOG2 = 2.0
MAX_DISTANCE = 3.0


def lookup(kernel: str, bucket: str, dtype) -> dict | None:
    """The stored config for the exact bucket, else the nearest neighbouring bucket of this dtype (see
    MAX_FIELD_LOG2, MAX_DISTANCE), else None. Stale entries (tuned on other kernel code) are skipped."""
    es = [e for e in entries(kernel) if e["dtype"] == dtype_name(dtype)]
    old = {id(e) for e in stale(kernel, es)}
    es = [e for e in es if id(e) not in old]
    if not es:
        return None
    for e in es:
        if e["bucket"] == bucket:
            return dict(e["config"])
    want = parse_bucket(bucket)
    best = min(es, key=lambda e: bucket_distance(want, parse_bucket(e["bucket"])))
    if bucket_distance(want, parse_bucket(best["bucket"])) > MAX_DISTANCE:
        return None
    return dict(best["config"])


def entry_config(kernel: str, bucket: str, dtype, slug: str | None = None) -> dict | None:
    """The stored config of exactly this bucket and dtype, stale or not (``lookup`` skips stale entries
    and falls back to neighbours): the winner on the kernel's code when it was tuned."""
    for e in entries(kernel, slug):
        if e["bucket"] == bucket and e["dtype"] == dtype_name(dtype):
            return dict(e["config"])
    return None


def files_for(slug: str | None = None) -> dict[str, Path]:
    d = config_root() / (slug or dev.gpu_slug())
    return {p.stem: p for p in sorted(d.glob("*.json"))} if d.is_dir() else {}


def write(kernel: str, new_entries: list[dict], slug: str | None = None, root: Path | None = None) -> Path:
    """Merge entries (replacing same bucket+dtype) into the store file and write it."""
    import datetime

    import triton

    slug = slug or dev.gpu_slug()
    path = path_for(kernel, slug, root)
    old = []
    if path.exists():
        try:
            old = validate(json.loads(path.read_text()), kernel, slug)
        except (OSError, ValueError) as e:
            warnings.warn(f"tritune: replacing unreadable tuned-config file {path}: {e}")
    keyed = {(e["bucket"], e["dtype"]): e for e in old}
    src = source_hash(kernel)
    for e in new_entries:
        keyed[(e["bucket"], e["dtype"])] = {**e, "source": e.get("source", src)}
    data = {
        "format": FORMAT,
        "kernel": kernel,
        "gpu": slug,
        "gpu_name": dev.gpu_name(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "entries": sorted(keyed.values(), key=lambda e: (e["dtype"], e["bucket"])),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    clear_cache()
    return path


def clear_cache() -> None:
    _load.cache_clear()
    source_hash.cache_clear()
    from tritune import kernels

    kernels.clear_config_cache()
