"""The tuned-config store: staleness on the kernel's code key, the one-time migration from the earlier hash,
and the messages for files or folders it cannot use (a corrupt store file, an unwritable HOME)."""
from __future__ import annotations

import ast
import importlib
import json
import linecache
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tritune.harness import cli
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import spec as spec_mod
from tritune.kernels.runtime import store
from tritune.kernels import gelu as gelu_mod

BUCKET = "numel=4096,approximate=none"
CONFIG = {"BLOCK": 1024, "num_warps": 4, "EVICT": False}


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """Empty packaged and user stores; yields the packaged store's root."""
    monkeypatch.setenv("TRITUNE_CONFIGS", str(tmp_path / "packaged"))
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path / "user"))
    store.clear_cache()
    yield tmp_path / "packaged"
    store.clear_cache()


def _entry(source=None, bucket=BUCKET):
    e = {"bucket": bucket, "dtype": "float32", "config": dict(CONFIG), "time_us": 1.0, "default_us": 2.0}
    return e if source is None else {**e, "source": source}


def _insert_line(text: str, function: str, line: str) -> str:
    """``text`` with ``line`` put before the first statement of ``function``'s body (its indentation)."""
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == function)
    first = node.body[1] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
        else node.body[0]   # after a docstring
    lines = text.splitlines(keepends=True)
    lines.insert(first.lineno - 1, " " * first.col_offset + line + "\n")
    return "".join(lines)


@pytest.fixture
def gelu_copy(tmp_path, monkeypatch):
    """A function text -> the lookup of the stored gelu entry, with gelu's kernel module replaced by a copy
    of kernels/gelu.py made from that text (registered in a registry of its own)."""
    pkg = tmp_path / "copypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)   # rewritten within a second: no stale .pyc
    monkeypatch.setattr(spec_mod, "REGISTRY", {})
    monkeypatch.setenv("TRITUNE_CONFIGS", str(tmp_path / "packaged"))
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path / "user"))

    def load(text: str):
        (pkg / "gelu.py").write_text(text)
        sys.modules.pop("copypkg.gelu", None)
        spec_mod.REGISTRY.clear()
        linecache.clearcache()
        importlib.invalidate_caches()
        importlib.import_module("copypkg.gelu")
        store.clear_cache()
        assert spec_mod.REGISTRY["gelu"].run.__module__ == "copypkg.gelu"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the stale-entries warning: what is asserted is the lookup
            return store.lookup("gelu", BUCKET, torch.float32, slug="gpu")

    yield load
    sys.modules.pop("copypkg.gelu", None)
    store.clear_cache()


def test_an_edit_of_the_jitted_code_makes_the_entries_stale_an_edit_of_the_launcher_does_not(gelu_copy):
    text = Path(gelu_mod.__file__).read_text()
    assert gelu_copy(text) is None
    store.write("gelu", [_entry()], slug="gpu", root=Path(os.environ["TRITUNE_CONFIGS"]))
    assert gelu_copy(text) == CONFIG
    key = store.source_hash("gelu")
    # the Python around the kernels: the launcher's body, and every kernel moved down the file
    launcher = _insert_line('# one more line above every kernel\n' + text, "gelu", "_unused = 1")
    assert gelu_copy(launcher) == CONFIG and store.source_hash("gelu") == key
    # the kernel's own jitted code, and a jitted function it calls
    assert gelu_copy(_insert_line(text, "_gelu_fwd", "numel = numel + 0")) is None
    assert gelu_copy(_insert_line(text, "_erfc", "z = z + 0.0")) is None
    assert store.source_hash("gelu") not in (None, key)
    assert gelu_copy(text) == CONFIG


def test_the_code_key_is_the_same_under_the_interpreter_and_with_jit_functions():
    """With TRITON_INTERPRET=0 a kernel's jitted functions are JITFunctions, as on a GPU (no GPU is needed to
    make them): their keys must be those the interpreter's InterpretedFunctions give."""
    code = ("import json; from tritune.kernels.runtime import spec, store\n"
            "print(json.dumps({n: store.source_hash(spec.get(n)) for n in ('gelu', 'gemm', 'layer_norm')}))")

    def keys(interpret: str) -> dict:
        env = {**os.environ, "TRITON_INTERPRET": interpret}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    on_cpu = keys("1")
    assert all(on_cpu.values()) and on_cpu == keys("0")


def test_migration_moves_current_entries_and_leaves_stale_ones_stale(stores):
    slug = "gpu"
    old = store._old_rule_hash(gelu_mod.gelu.__module__)
    assert old and old != store.source_hash("gelu")
    path = stores / slug / "gelu.json"
    path.parent.mkdir(parents=True)
    other = "numel=8192,approximate=none"
    data = {"format": 1, "kernel": "gelu", "gpu": slug, "triton": "3.6.0", "torch": "2.11", "date": "2026-11-23",
            "entries": [_entry(old), _entry("0123456789ab", other), _entry(bucket="numel=1024,approximate=tanh")]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.lookup("gelu", BUCKET, torch.float32, slug=slug) is None        # the old hash: stale today
        assert store.migrate_sources(["gelu"], slug) == {(slug, "gelu"): (1, 1)}
        assert store.lookup("gelu", BUCKET, torch.float32, slug=slug) == CONFIG       # current: moved
        assert store.lookup("gelu", other, torch.float32, slug=slug) == CONFIG        # the stale one skipped:
        assert [e["bucket"] for e in store.stale("gelu", store.entries("gelu", slug))] == [other]  # its neighbour
    es = json.loads(path.read_text())["entries"]
    assert [e.get("source") for e in es] == [store.source_hash("gelu"), "0123456789ab", None]
    assert {k: v for k, v in json.loads(path.read_text()).items() if k != "entries"} == \
        {k: v for k, v in data.items() if k != "entries"}   # the sweep's versions and date stay
    assert store.migrate_sources(["gelu"], slug) == {(slug, "gelu"): (0, 1)}      # once: nothing more to move


def _unwritable_home(tmp_path, monkeypatch):
    """HOME a file (so nothing can be made under it, whoever runs the test) and no override set."""
    home = tmp_path / "home"
    home.write_text("")
    monkeypatch.setenv("HOME", str(home))
    for var in ("TRITUNE_CACHE", "TRITUNE_STUDIES", "TRITUNE_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    store.clear_cache()
    return home


def test_an_unwritable_home_is_one_line_naming_what_and_where_else(tmp_path, monkeypatch, capsys):
    home = _unwritable_home(tmp_path, monkeypatch)
    assert cli.main(["tune", "gelu", "--trials", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tritune: error: cannot write the studies journal")
    assert str(home) in err and all(w in err for w in ("TRITUNE_CONFIG_DIR", "--configs-dir", "--storage"))

    with pytest.raises(dev.CacheError, match="the user config store.*TRITUNE_CONFIG_DIR.*--configs-dir"):
        store.write("gelu", [_entry()], slug="gpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.lookup("gelu", BUCKET, torch.float32, slug="gpu") is None   # reading needs no HOME
    store.clear_cache()


def test_info_warns_about_a_store_file_lookups_skip(stores, monkeypatch, capsys):
    user = Path(os.environ["TRITUNE_CONFIG_DIR"]) / dev.gpu_slug()
    user.mkdir(parents=True)
    (user / "gelu.json").write_text('{"kernel": "gelu", "entries": [')
    (user / "gemm.json").write_text(json.dumps({"kernel": "gemv", "gpu": dev.gpu_slug(), "entries": []}))
    assert cli.main(["info"]) == 0
    err = capsys.readouterr().err
    assert f"{user / 'gelu.json'} is ignored" in err and "invalid JSON" in err
    assert f"{user / 'gemm.json'} is ignored" in err and "written for kernel 'gemv'" in err


KERN = '''import triton
import triton.language as tl
from hashpkg2 import side as G
from hashpkg2.other import _shared

{pad}
@triton.jit
def _own(x):
    return _shared(x)


def launcher():
    """{doc}"""
'''
SIDE = '''import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate

SCALE: tl.constexpr = tl.constexpr({scale})

if True:   # as a Gluon module defines its kernels: under a test of what its triton has
    @aggregate
    class Pair:
        a: tl.tensor
        b: tl.tensor

        @triton.constexpr_function
        def __init__(self, a, b):
            self.a = a
            self.b = {field}

    @triton.jit
    def _side(x):
        p = Pair(x, x)
        return p.a * SCALE
'''


def test_the_code_key_covers_held_modules_imported_functions_aggregates_and_constexprs(tmp_path, monkeypatch):
    """A kernel module's key: its own and imported jitted functions, those of the modules of its package it
    holds (attention's Gluon module), the aggregates they name and the constexpr globals they read; not
    the Python around them nor where they sit in the file."""
    pkg = tmp_path / "hashpkg2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def key(doc="a", pad="", shared=1, scale=2, field="b"):
        (pkg / "kern.py").write_text(KERN.format(doc=doc, pad=pad))
        (pkg / "side.py").write_text(SIDE.format(scale=scale, field=field))
        (pkg / "other.py").write_text(f"import triton\n\n\n@triton.jit\ndef _shared(x):\n    return x + {shared}\n")
        for m in [m for m in sys.modules if m.startswith("hashpkg2")]:
            del sys.modules[m]
        linecache.clearcache()
        importlib.invalidate_caches()
        importlib.import_module("hashpkg2.kern")
        store.module_hash.cache_clear()
        return store.module_hash("hashpkg2.kern")

    try:
        base = key()
        assert base is not None and len(base) == 12
        assert key(doc="b", pad="\n\n# moved down\n") == base    # the launcher, and the kernels' line numbers
        assert key(shared=5) != base                             # an imported jitted function (and its caller)
        assert key(scale=3) != base                              # a constexpr global a held module's kernel reads
        assert key(field="a") != base                            # an aggregate that kernel names
        assert key() == base
    finally:
        for m in [m for m in sys.modules if m.startswith("hashpkg2")]:
            del sys.modules[m]
        store.module_hash.cache_clear()


def test_a_neighbours_config_that_does_not_carry_over_is_not_borrowed(stores):
    """gemv at M=4 with only the M=1 bucket stored: the M=1 winner's one-row tile would read the weight four
    times, so the default runs; M=2 likewise; M=1 takes its entry, and an M=4 bucket's own one-row winner is
    used as stored (a tuned choice, not a borrowed one)."""
    from tritune.kernels import gemv as G

    one_row = {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}
    problems = {m: G.Problem(m, 3072, 2048, rms=True) for m in (1, 2, 4)}
    key = {m: spec_mod.bucket_key(G.SPEC.bucket(p)) for m, p in problems.items()}

    def write(*buckets):
        path = stores / dev.gpu_slug() / "gemv.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": 1, "kernel": "gemv", "gpu": dev.gpu_slug(), "triton": "3.6.0",
                                    "torch": "2.11", "date": "2026-11-29",
                                    "entries": [{"bucket": b, "dtype": "float16", "config": dict(one_row),
                                                 "time_us": 1.0, "default_us": 2.0} for b in buckets]}))
        store.clear_cache()

    write(key[1])
    assert G.SPEC.config_for(problems[1], torch.float16) == one_row
    for m in (2, 4):
        why = G.borrow(one_row, problems[m], torch.float16)
        assert why == f"BLOCK_M=1 would read the weight {m} times for {m} rows"
        assert G.SPEC.config_for(problems[m], torch.float16) == G.default_config(problems[m], torch.float16)
    write(key[1], key[4])
    assert G.SPEC.config_for(problems[4], torch.float16) == one_row


def test_quant_matmul_does_not_borrow_the_one_row_kernel_for_more_rows():
    from tritune.kernels import quant_matmul as Q

    one_row = dict(Q.default_config(Q.Problem(1, 4096, 4096), torch.float16), BLOCK_M=1)
    assert Q.borrow(one_row, Q.Problem(1, 4096, 4096), torch.float16) is None
    why = Q.borrow(one_row, Q.Problem(4, 4096, 4096), torch.float16)
    assert why == "BLOCK_M=1 would read the weight 4 times for 4 rows"
    assert Q.borrow(dict(one_row, BLOCK_M=64), Q.Problem(512, 4096, 4096), torch.float16) is None   # GEMM tiles
