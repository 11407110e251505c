"""Tuned configs per GPU type: ``<store>/<gpu-slug>/<kernel>.json``, in two layers.

- the packaged store, ``tuning/configs/`` (``TRITUNE_CONFIGS`` swaps it for another directory): what the
  project measured and committed;
- the user store, ``$TRITUNE_CONFIG_DIR`` or ``<user cache dir>/tritune/configs`` (``~/.cache/...``):
  where ``tritune tune --export`` writes, so a reinstall loses nothing. Its entries win over the packaged
  ones of the same (bucket, dtype).

A file holds, for each (bucket, dtype), the winning config, its median time, the default config's
time, the trials it took, and the date, triton and torch versions of the sweep. Files are validated on
load: a malformed file, or one written for another kernel or GPU, is skipped with a warning naming it,
never a crash and never a config for the wrong kernel.

Lookup: exact bucket, else the nearest neighbouring bucket of the same dtype (log-distance over the
numeric fields, each within 4x; non-numeric fields must match), else ``None`` (the caller uses the
heuristic default). Entries tuned against other code of the kernel (stale) are skipped. Files are read
once per process; launchers cache the result per (kernel, bucket, dtype), so the hot path does no I/O.

The store never imports the spec module (the spec imports the store): a kernel is named by its
spec or by its name in the registry of the already-imported kernels package.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import math
import os
import sys
import textwrap
import types
import warnings
from pathlib import Path

import torch

from tritune.kernels.runtime import device as dev

PACKAGE_CONFIGS = Path(__file__).resolve().parents[2] / "tuning" / "configs"  # package data of tritune.tuning
FORMAT = 1
TUNE_COMMAND = "tritune tune all --budget 30m --export"


def package_root() -> Path:
    """The packaged store; ``TRITUNE_CONFIGS`` (a directory holding ``<slug>/<kernel>.json``) replaces it."""
    return Path(os.environ.get("TRITUNE_CONFIGS") or PACKAGE_CONFIGS)


def user_root() -> Path:
    """The user store: ``$TRITUNE_CONFIG_DIR``, else ``configs/`` in tritune's user cache directory."""
    d = os.environ.get("TRITUNE_CONFIG_DIR")
    return Path(d).expanduser() if d else dev.cache_path() / "configs"


def layers() -> list[tuple[str, Path]]:
    """(name, root) of each store, lowest priority first."""
    out = [("packaged", package_root())]
    user = user_root()
    if user.resolve() != out[0][1].resolve():
        out.append(("user", user))
    return out


def dtype_name(dtype) -> str:
    """The store's dtype key: a torch dtype (``torch.float32`` -> ``"float32"``) or a key string as is
    (e.g. ``"tfloat32"``, fp32 tuned with tf32 dots allowed)."""
    return dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")


def torch_dtype(name: str):
    """The torch dtype a store key runs in (``"tfloat32"`` is float32 data)."""
    name = dtype_name(name)
    dt = getattr(torch, name[1:] if name.startswith("tfloat") else name, None)
    return dt if isinstance(dt, torch.dtype) else None


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


def bucket_distance(a: dict, b: dict, max_field_log2: float | None = None) -> float:
    """Sum over numeric fields of |log2 a - log2 b|; inf when the keys or a non-numeric field differ, or
    when one numeric field is more than ``max_field_log2`` (default MAX_FIELD_LOG2) away."""
    if set(a) != set(b):
        return math.inf
    cap = MAX_FIELD_LOG2 if max_field_log2 is None else max_field_log2
    d = 0.0
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, int) and isinstance(y, int) and x > 0 and y > 0:
            f = abs(math.log2(x) - math.log2(y))
            if f > cap:
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


def read(path: Path, kernel: str, slug: str | None = None) -> list[dict]:
    """The entries of a store file; StoreError saying why it cannot be used (unreadable, invalid JSON, or
    :func:`validate`'s reasons)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise StoreError(f"unreadable: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise StoreError(f"invalid JSON: {e}") from None
    return validate(data, kernel, slug)


def broken_files(slug: str | None = None) -> list[tuple[Path, str]]:
    """(file, why) for each store file of a GPU type, in either store, that lookups skip as unusable."""
    slug = slug or dev.gpu_slug()
    out = []
    for _, root in layers():
        for p in sorted((root / slug).glob("*.json")) if (root / slug).is_dir() else ():
            try:
                read(p, p.stem, slug)
            except StoreError as e:
                out.append((p, str(e)))
    return out


def _spec(kernel):
    """A spec from a spec or a kernel name; None when no kernel of that name is registered. The registry
    is read from the kernels package only if something already imported it (no import cycle)."""
    if not isinstance(kernel, str):
        return kernel
    kernels = sys.modules.get("tritune.kernels.runtime.spec")
    return None if kernels is None else getattr(kernels, "REGISTRY", {}).get(kernel)


# Stored configs of launches that are no registered kernel (the model's fused decode step, whose launcher
# takes a whole model): name -> (module, class with a ``from_dict`` that raises ValueError on a bad config).
CONFIG_KINDS = {"fused_decode": ("tritune.kernels.fused_decode", "Config")}


def config_check(kernel: str):
    """For a stored name that is no registered kernel but a known config kind: a function config -> why it
    is invalid (None: valid). None for an unknown name."""
    where = CONFIG_KINDS.get(kernel)
    if where is None:
        return None
    import importlib

    cls = getattr(importlib.import_module(where[0]), where[1])

    def why(config: dict) -> str | None:
        try:
            cls.from_dict(dict(config))
        except (ValueError, TypeError) as e:
            return str(e)
        return None
    return why


def kernel_name(kernel) -> str:
    return kernel if isinstance(kernel, str) else kernel.name


def source_hash(kernel) -> str | None:
    """The code key of the kernel's module (the kernel named by its spec, or by its registered name): an entry
    records the code it was timed on, so a config tuned for another version of the kernel is known as stale.
    :func:`module_hash` says what counts."""
    spec = _spec(kernel)
    run = getattr(spec, "run", None)
    mod = getattr(run, "__module__", None)
    return None if mod is None else module_hash(mod)


def _python_function(obj):
    """The Python function under a triton- or Gluon-jitted object (JITFunction, the interpreter's
    InterpretedFunction, GluonJITFunction, an autotuner around one); None for anything else, and for Triton's
    own library functions (``tl.cdiv``...: they move with the triton version, which the file records)."""
    fn = obj
    while type(fn).__module__.startswith("triton") and callable(getattr(fn, "fn", None)):
        fn = fn.fn
    if fn is obj or not inspect.isfunction(fn) or fn.__module__.startswith("triton"):
        return None
    return fn


def _reads(fn) -> list:
    """The values the names of a function's body resolve to (its globals and closure; ``M.x`` through a
    module), skipping its parameters and local variables."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    scope = {**fn.__globals__, **inspect.getclosurevars(fn).nonlocals}
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}

    def value(node):
        if isinstance(node, ast.Name):
            return None if node.id in local else scope.get(node.id)
        base = value(node.value) if isinstance(node, ast.Attribute) else None
        return getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
    return [(ast.unparse(n), value(n)) for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))]


def _function_key(fn, memo: dict) -> str:
    """Triton's ``cache_key`` recipe without its line number, read from the Python function (so the same
    under the interpreter): the function's source with its decorators, the keys of the jitted functions and
    aggregates it names, and the constexpr globals it reads."""
    if fn in memo:
        return memo[fn]
    memo[fn] = f"recursion:{fn.__name__}"
    from triton.language import constexpr

    calls, consts = set(), set()
    if isinstance(fn, type):   # a Triton aggregate (a struct of a Gluon kernel): its text and its methods
        reads = [(name, v) for name, v in vars(fn).items() if _python_function(v) is not None]
    else:
        reads = _reads(fn)
    for text, val in reads:
        callee = _python_function(val) or (val if getattr(val, "__triton_aggregate__", False) else None)
        if callee is not None:
            calls.add(_function_key(callee, memo))
        elif isinstance(val, constexpr):
            consts.add(f"{text}={val.value!r}")
    text = "\n".join([textwrap.dedent(inspect.getsource(fn)), *sorted(calls), *sorted(consts)])
    memo[fn] = hashlib.sha256(text.encode()).hexdigest()
    return memo[fn]


def launched(mod) -> list[tuple[str, object]]:
    """(name, Python function) of the jitted functions a kernel module launches: those in its namespace
    (defined there or imported), and those of the modules of its own package it holds (attention's Gluon
    module). The functions they call are covered by each one's key (:func:`_function_key`)."""
    pkg = mod.__name__ if hasattr(mod, "__path__") else mod.__name__.rpartition(".")[0]
    spaces = [vars(mod)] + [vars(m) for m in vars(mod).values()
                            if isinstance(m, types.ModuleType) and m is not mod and m.__name__.rpartition(".")[0] == pkg]
    out = {}
    for space in spaces:
        for name, obj in space.items():
            fn = _python_function(obj)
            if fn is not None:
                out.setdefault(fn, name)   # one function under two names (imported as another) counts once
    return sorted(((name, fn) for fn, name in out.items()), key=lambda t: t[0])


@functools.lru_cache(maxsize=None)
def module_hash(modname: str) -> str | None:
    """The code key of a kernel module: sha256 (12 hex digits) over the name and :func:`_function_key` of
    each function it launches (:func:`launched`). The Python around the jitted code (the launcher, docs,
    checks, where a function sits in its file, the module's name) does not count; any edit of a launched
    jitted function, of a jitted function or aggregate it names, or of a constexpr global it reads does
    (tuning/configs/README.md: why not Triton's ``cache_key`` as is). None when the module is not imported
    or launches nothing."""
    mod = sys.modules.get(modname)
    if mod is None:
        return None
    memo = {}
    try:
        keys = sorted(f"{name}={_function_key(fn, memo)}" for name, fn in launched(mod))
    except (OSError, TypeError, SyntaxError):
        return None
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:12] if keys else None


def _old_rule_hash(modname: str) -> str | None:
    """The code hash entries recorded before :func:`module_hash` (for :func:`migrate_sources`): sha256 of the
    source of the module's own and imported jitted functions, and of every ``...jit``-decorated function in
    the source text of the private modules of its package it holds."""
    mod = sys.modules.get(modname)
    if mod is None:
        return None
    pkg, top = mod.__name__.rpartition(".")[0], mod.__name__.split(".", 1)[0]
    srcs, helpers = [], []
    for name, obj in sorted(vars(mod).items()):
        if callable(getattr(obj, "fn", None)) and type(obj).__module__.startswith("triton") \
                and getattr(obj.fn, "__module__", "").split(".", 1)[0] == top:
            srcs.append(f"{name}\n{inspect.getsource(obj.fn)}")
        elif isinstance(obj, types.ModuleType) and obj.__name__.startswith(pkg + "._"):
            helpers.append(obj)
    for h in sorted(helpers, key=lambda m: m.__name__):
        text = inspect.getsource(h)
        found = sorted((n.name, ast.get_source_segment(text, n)) for n in ast.walk(ast.parse(text))
                       if isinstance(n, ast.FunctionDef) and any(
                           ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] == "jit"
                           for d in n.decorator_list))
        srcs += [f"+{name}\n{src}" for name, src in found]
    return hashlib.sha256("\n".join(srcs).encode()).hexdigest()[:12] if srcs else None


def migrate_sources(kernel_names=None, slug: str | None = None, old: dict | None = None,
                    root: Path | None = None) -> dict:
    """Move a store's entries from the earlier code hash to :func:`source_hash`, once: an entry whose
    ``source`` is its kernel's hash under the earlier rule (:func:`_old_rule_hash` of the kernel's module as
    it is now, or ``old[kernel]`` where given: the earlier hash of code the caller knows to be the current
    jitted code, for a module that moved since) gets the current key; any other entry keeps its value and
    so still reads stale. ``kernel_names``: those files only (default all); ``slug``: that GPU type only;
    ``root``: the store (default the packaged one). Kernels must be registered (imported) first. Returns
    {(slug, kernel): (entries moved, entries left stale)}; a file holding neither is not rewritten."""
    root = Path(root or package_root())
    dirs = [root / slug] if slug else sorted(d for d in root.iterdir() if d.is_dir())
    out = {}
    for d in dirs:
        for path in sorted(d.glob("*.json")):
            name = path.stem
            if kernel_names is not None and name not in kernel_names:
                continue
            spec = _spec(name)
            if spec is None:
                continue   # no registered kernel (fused_decode's configs record no source)
            new, was = source_hash(spec), (old or {}).get(name) or _old_rule_hash(spec.run.__module__)
            data = json.loads(path.read_text())
            validate(data, name, d.name)
            moved = left = 0
            for e in data["entries"]:
                if e.get("source") in (None, new):
                    continue
                if e["source"] == was:
                    e["source"], moved = new, moved + 1
                else:
                    left += 1
            out[(d.name, name)] = (moved, left)
            if moved:
                tmp = path.with_suffix(".json.tmp")
                tmp.write_text(json.dumps(data, indent=1) + "\n")
                os.replace(tmp, path)
    clear_cache()
    return out


def stale(kernel, es) -> list[dict]:
    """Entries tuned against another version of the kernel's jitted code (entries that record none are
    not judged). Lookup skips them: a config timed on other code is neither verified nor known fast
    (a gemm sweep found such entries 1.1-13x slower than the current defaults)."""
    h = source_hash(kernel)
    return [e for e in es if h is not None and e.get("source") not in (None, h)]


def bucket_key_of(spec, problem) -> str:
    return ",".join(f"{k}={v}" for k, v in spec.bucket(problem).items())


def problem_of_entry(spec, e: dict):
    """The problem an entry was tuned on, where it can be known: its recorded fields, else one of the
    spec's standard or small problems in the entry's bucket; None otherwise."""
    import dataclasses

    probs = list(getattr(spec, "standard_problems", []) or []) + list(getattr(spec, "small_problems", []) or [])
    fields = e.get("problem_fields")
    if isinstance(fields, dict) and probs and dataclasses.is_dataclass(probs[0]):
        try:
            return type(probs[0])(**fields)
        except TypeError:
            pass
    for p in probs:
        try:
            if bucket_key_of(spec, p) == e.get("bucket"):
                return p
        except Exception:
            continue
    return None


def why_invalid(spec, e: dict) -> str | None:
    """Why a stored entry's config is no point of the kernel's space (an unknown or mistyped key, a block
    of 3, zero warps, a broken constraint), via ``spec.space.why_invalid``; None when it is valid (or the
    constraint cannot be judged without the problem). Launchers never use such an entry."""
    dtype = torch_dtype(e.get("dtype", ""))
    problem = problem_of_entry(spec, e)
    try:
        return spec.space.why_invalid(dict(e["config"]), problem, dtype)
    except Exception as exc:  # a constraint that needs the problem: the keys and choices passed
        if problem is None:
            return None
        return f"constraint check failed: {type(exc).__name__}: {exc}"


def path_for(kernel, slug: str | None = None, root: Path | None = None) -> Path:
    """Where ``write`` puts a kernel's file: under ``root``, default the user store."""
    return Path(root or user_root()) / (slug or dev.gpu_slug()) / f"{kernel_name(kernel)}.json"


@functools.lru_cache(maxsize=None)
def _load(path: str, kernel: str, slug: str) -> tuple:
    p = Path(path)
    if not p.exists():
        return ()
    try:
        es = tuple(read(p, kernel, slug))
    except StoreError as e:
        warnings.warn(f"tritune: ignoring tuned-config file {p}: {e}; using heuristic defaults", stacklevel=3)
        return ()
    old = stale(kernel, es)
    if old:  # still valid points of the space (checked at lookup), but timed on other code: say so once
        warnings.warn(f"tritune: {len(old)} of {len(es)} entries in {p} were tuned against another version of "
                      f"the {kernel} kernel; they are skipped (heuristic defaults instead): re-run "
                      f"`tritune tune {kernel} --export` to refresh them (without --export the new winners "
                      f"stay in the study storage)",
                      stacklevel=3)
    return es


def layered(kernel, slug: str | None = None) -> list[tuple[dict, str, Path, bool]]:
    """Every stored entry of a kernel for a GPU type, as (entry, store name, file, overridden): the
    packaged store's first, then the user store's; an entry is overridden when a higher store holds the
    same (bucket, dtype)."""
    name = kernel_name(kernel)
    slug = slug or dev.gpu_slug()
    rows = []
    for layer, root in layers():
        p = root / slug / f"{name}.json"
        rows += [(e, layer, p) for e in _load(str(p), name, slug)]
    top = {}
    for i, (e, _, _) in enumerate(rows):
        top[(e["bucket"], e["dtype"])] = i
    return [(e, layer, p, top[(e["bucket"], e["dtype"])] != i) for i, (e, layer, p) in enumerate(rows)]


def entries(kernel, slug: str | None = None) -> tuple:
    """The effective entries of a kernel (user store over packaged store)."""
    if slug is None:
        _warn_if_untuned()
    return tuple(e for e, _, _, over in layered(kernel, slug) if not over)


_WARNED_UNTUNED = []


def _warn_if_untuned() -> None:
    """One warning per process on a GPU that no store has configs for: name the command that tunes it."""
    if _WARNED_UNTUNED or dev.interpreted():
        return
    _WARNED_UNTUNED.append(True)
    slug = dev.gpu_slug()
    if not any(files_for(slug, layer=name) for name, _ in layers()):
        warnings.warn(f"tritune: no tuned configs for this GPU ({slug}) in the packaged store or the user store "
                      f"({user_root() / slug}): kernels use heuristic defaults; `{TUNE_COMMAND}` tunes this GPU",
                      stacklevel=4)


# Nearest-bucket fallback only between neighbours: each numeric field within a factor of 4, and at most
# three octaves in all. A config tuned at M=1 says nothing about M=8192 (it handed 8192^3 a 32x16 tile).
MAX_FIELD_LOG2 = 2.0
MAX_DISTANCE = 3.0


def lookup(kernel, bucket: str, dtype, slug: str | None = None) -> dict | None:
    """The stored config for the exact bucket, else the nearest neighbouring bucket of this dtype (see
    MAX_FIELD_LOG2, MAX_DISTANCE), else None. ``kernel`` is a spec or a registered name; ``dtype`` a torch
    dtype or a key string such as ``"tfloat32"``. Stale entries (tuned on other kernel code) are skipped."""
    es = [e for e in entries(kernel, slug) if e["dtype"] == dtype_name(dtype)]
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


def entry_config(kernel, bucket: str, dtype, slug: str | None = None) -> dict | None:
    """The stored config of exactly this bucket and dtype, stale or not (``lookup`` skips stale entries
    and falls back to neighbours): the winner on the kernel's code when it was tuned."""
    for e in entries(kernel, slug):
        if e["bucket"] == bucket and e["dtype"] == dtype_name(dtype):
            return dict(e["config"])
    return None


def files_for(slug: str | None = None, layer: str | None = None) -> dict[str, Path]:
    """kernel -> the file that holds its configs for a GPU type (the user store's where both have one);
    ``layer`` ('packaged' or 'user'): that store's files only."""
    out = {}
    for name, root in layers():
        if layer is not None and name != layer:
            continue
        d = root / (slug or dev.gpu_slug())
        if d.is_dir():
            out.update({p.stem: p for p in sorted(d.glob("*.json"))})
    return dict(sorted(out.items()))


def slugs() -> list[str]:
    """The GPU types any store holds configs for."""
    out = set()
    for _, root in layers():
        if root.is_dir():
            out |= {d.name for d in root.iterdir() if d.is_dir() and any(d.glob("*.json"))}
    return sorted(out)


def write(kernel, new_entries: list[dict], slug: str | None = None, root: Path | None = None) -> Path:
    """Merge entries (replacing same bucket+dtype) into the kernel's file under ``root`` (default: the
    user store) and write it."""
    import datetime

    import triton

    name = kernel_name(kernel)
    slug = slug or dev.gpu_slug()
    path = path_for(name, slug, root)
    old = []
    if path.exists():
        try:
            old = read(path, name, slug)
        except StoreError as e:
            warnings.warn(f"tritune: replacing unreadable tuned-config file {path}: {e}")
    keyed = {(e["bucket"], e["dtype"]): e for e in old}
    src = source_hash(kernel)
    for e in new_entries:
        keyed[(e["bucket"], e["dtype"])] = {**e, "source": e.get("source", src)}
    data = {
        "format": FORMAT,
        "kernel": name,
        "gpu": slug,
        "gpu_name": dev.gpu_name(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "entries": sorted(keyed.values(), key=lambda e: (e["dtype"], e["bucket"])),
    }
    what = "the user config store" if root is None else "tuned configs"
    tmp = path.with_suffix(".json.tmp")
    try:
        dev.make_dir(path.parent, what)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)  # a reader (or a kill) never sees half a file
    except dev.CacheError:
        raise
    except OSError as e:
        raise dev.CacheError(f"cannot write {what}: {path}: {e.strerror or e}; {dev.ELSEWHERE}") from None
    clear_cache()
    return path


def clear_cache() -> None:
    _load.cache_clear()
    module_hash.cache_clear()
    kernels = sys.modules.get("tritune.kernels.runtime.spec")
    if kernels is not None:
        kernels.clear_config_cache()
