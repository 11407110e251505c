"""Kernels from outside the package: the public API, --plugin / TRITUNE_PLUGINS, entry points (the example
package), the shipped contract tests, and tritune plot. The CLI flows run in subprocesses: a plugin's
kernel must not leak into this process's registry."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A plugin kernel whose problem dataclass lives in another module than the one that registers it: worker
# processes unpickle it by module path.
PROBLEMS = '''
from dataclasses import dataclass

@dataclass(frozen=True)
class Problem:
    n: int
'''
PLUGIN = '''
import torch, triton, triton.language as tl
from tritune import Case, Cost, KernelSpec, Space, check_tensor, randn, register, sizes
from my_problems import Problem

@triton.jit
def _twice(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * 2, mask=offs < n)

def twice(x, *, out=None, config=None):
    check_tensor("x", x, ndim=1, dtypes=(torch.float32,))
    cfg = SPEC.config_for(Problem(x.numel()), x.dtype, config)
    out = torch.empty_like(x) if out is None else out
    _twice[(triton.cdiv(x.numel(), cfg["BLOCK"]),)](x, out, x.numel(), BLOCK=cfg["BLOCK"])
    return out

def problems(cap):
    from hypothesis import strategies as st
    return st.builds(Problem, sizes(min(cap, 4096)))

SPEC = register(KernelSpec(
    name="my_twice", run=twice, reference=lambda x: 2 * x.double(),
    make_inputs=lambda p, dtype, device, seed, layout="contiguous": Case(
        args=(randn((p.n,), dtype, device, seed),), out=torch.empty(p.n, dtype=dtype, device=device)),
    problems=problems, space=Space({"BLOCK": [16, 32, 64, 128]}), default_config=lambda p, d: {"BLOCK": 64},
    bucket=lambda p: {"n": p.n}, cost=lambda p, d: Cost(p.n, 8 * p.n), problem_of=lambda x: Problem(x.numel()),
    standard_problems=[Problem(1 << 20)], small_problems=[Problem(1000), Problem(37)], dtypes=(torch.float32,),
    description="y = 2x, a plugin"))
'''


def _run(args, cwd, env=None, timeout=300):
    e = {k: v for k, v in os.environ.items() if k != "TRITUNE_PLUGINS"}
    e.update(env or {})
    return subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def _tritune(*args):
    return [sys.executable, "-m", "tritune.harness.cli", *args]


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / "my_problems.py").write_text(PROBLEMS)
    (tmp_path / "my_twice.py").write_text(PLUGIN)
    return tmp_path


def test_public_api_is_light_and_complete():
    code = ("import sys, tritune; assert 'torch' not in sys.modules, 'import tritune imported torch'; "
            "import tritune.kernels as k; assert tritune.KernelSpec is k.KernelSpec and tritune.register is k.register; "
            "assert set(tritune.__all__) <= set(dir(tritune)); "
            "import tritune.testing.pytest_plugin; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    import tritune

    for name in tritune.__all__:
        if name != "patch" or importlib.util.find_spec("tritune.model.patch"):
            assert getattr(tritune, name) is not None, name


def test_plugin_kernel_through_every_command(plugin_dir):
    """--plugin FILE: info lists it, bench runs it, tune sweeps it with 2 worker processes (which load the
    plugin and unpickle its problems from another module), configs and the contract tests see it."""
    env = {"TRITUNE_STUDIES": str(plugin_dir / "studies.journal"), "TRITUNE_CACHE": str(plugin_dir / "cache"),
           "TRITUNE_CONFIG_DIR": str(plugin_dir / "configs")}
    r = _run(_tritune("--plugin", "my_twice.py", "info"), plugin_dir, env)
    assert r.returncode == 0 and "my_twice" in r.stdout, r.stderr
    r = _run(_tritune("bench", "my_twice", "--plugin", "my_twice", "--results-dir", "res", "--no-peers"), plugin_dir, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (plugin_dir / "res").is_dir() and list((plugin_dir / "res").rglob("my_twice.json"))
    r = _run(_tritune("--plugin", "my_twice", "tune", "my_twice", "--trials", "2", "--workers", "2",
                      "--problems", "n=1000", "--quiet"), plugin_dir, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "my_twice" in r.stdout and "n=1000" in r.stdout
    # TRITUNE_PLUGINS alone, and the shipped contract tests outside a checkout
    r = _run(_tritune("test", "-q", "-m", "my_twice", "-k", "spec_is_complete or matches_reference"), plugin_dir, dict(env, TRITUNE_PLUGINS="my_twice"))
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr


def test_pytest_tritune_kernel_option(tmp_path):
    r = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tritune-kernel", "gelu",
              "-k", "spec_is_complete or bad_inputs", "--rootdir", str(tmp_path)], tmp_path)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr


def _example_installed() -> bool:
    try:
        importlib.metadata.distribution("tritune-rms-norm-example")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _example_installed(), reason="examples/rms_norm not installed (pip install ./examples/rms_norm)")
def test_example_package_cli_flow(tmp_path):
    """The example kernel found through its entry point: tritune test, tune --trials 3, bench, from a folder
    that is not a checkout; nothing written into site-packages."""
    env = {"TRITUNE_STUDIES": str(tmp_path / "studies.journal"), "TRITUNE_CACHE": str(tmp_path / "cache"),
           "TRITUNE_CONFIG_DIR": str(tmp_path / "configs")}
    r = _run(_tritune("test", "-q", "-m", "my_rms_norm", "-k", "spec_is_complete or bad_inputs or invalid_config"),
             tmp_path, env)
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout + r.stderr
    r = _run(_tritune("tune", "my_rms_norm", "--trials", "3", "--dtype", "fp32", "--problems", "M=64,N=768",
                      "--export", "--quiet"), tmp_path, env)
    assert r.returncode == 0 and "my_rms_norm" in r.stdout, r.stdout + r.stderr
    site = Path(importlib.metadata.distribution("tritune").locate_file(""))
    assert not list(site.glob("tritune/tuning/configs/*/my_rms_norm.json"))  # exports go to the user store
    r = _run(_tritune("bench", "my_rms_norm", "--dtype", "fp32", "--results-dir", "res"), tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    from tritune.kernels.runtime import device as dev

    rows = json.loads((tmp_path / "res" / dev.gpu_slug() / "my_rms_norm.json").read_text())["rows"]
    assert rows and all(r["correct"] and r["vendor"] == "F.rms_norm" for r in rows), rows


def test_plot_roofline_and_study(tmp_path):
    pytest.importorskip("matplotlib")
    import optuna

    from tritune.harness import plot

    res = tmp_path / "results" / "some-gpu"
    res.mkdir(parents=True)
    rows = [{"kernel": k, "dtype": "bfloat16", "problem": str(i), "tflops": t, "gbps": g, "ours_us": 1.0}
            for i, (k, t, g) in enumerate([("gemm", 500.0, 800.0), ("gemm", 50.0, 1500.0), ("gelu", 2.0, 2900.0)])]
    env = {"ceilings": {"copy_bytes_per_s": 3e12, "matmul_flops_per_s_bfloat16": 7e14,
                        "matmul_flops_per_s_float32": 5e13}, "gpu": "Some GPU"}
    import json

    (res / "gemm.json").write_text(json.dumps({"environment": env, "rows": rows}))
    (res / "decode.json").write_text(json.dumps({"benchmark": "decode"}))  # not kernel rows: ignored
    paths = plot.render_all(tmp_path / "results", tmp_path / "img")
    assert [p.name for p in paths] == ["roofline-some-gpu.png"] and paths[0].stat().st_size > 10_000

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="gelu:n=1:float32:x", storage=url)
    study.optimize(lambda t: t.suggest_categorical("BLOCK", [1, 2, 4]) + t.suggest_int("w", 1, 4), n_trials=8)
    got = plot.study_plots(url, tmp_path / "img", ["gelu"])
    assert sorted(p.name.rsplit("-", 1)[-1] for p in got) == ["history.png", "importances.png"]


ORDER = '''
import transformers, torch, triton, triton.language as tl   # triton imported before tritune
@triton.jit
def _scaled(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Y + offs, x * 2 / (1 + 0 * tl.sum(x, axis=0)), mask=offs < n)   # tl.sum: triton's own jitted helper
import tritune
from tritune.kernels.runtime import device as dev

def run(x, *, out=None, config=None):
    out = torch.empty_like(x) if out is None else out
    _scaled[(1,)](x, out, x.numel(), BLOCK=128)
    return out

spec = tritune.KernelSpec(name="order", run=run, reference=lambda x: 2 * x.double(), make_inputs=None,
                          problems=None, space=tritune.Space({"B": [1]}), default_config=lambda p, d: {"B": 1},
                          bucket=None, cost=None, problem_of=None, standard_problems=[], small_problems=[])
x = torch.randn(100, device=dev.device())
assert torch.equal(spec.run(x), 2 * x)
cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=16, vocab_size=64, eos_token_id=0,
                              bos_token_id=0)
m = transformers.GPT2LMHeadModel(cfg).eval().to(dev.device())
with torch.no_grad():
    want = m(torch.tensor([[1, 2, 3]], device=dev.device())).logits
    tritune.patch(m)
    got = m(torch.tensor([[1, 2, 3]], device=dev.device())).logits
assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
print("ok")
'''


def test_user_kernel_and_patch_work_whatever_was_imported_first(tmp_path):
    """transformers (and so triton) imported before tritune, no TRITON_INTERPRET in the environment: a
    user kernel decorated then launches through a KernelSpec and tritune.patch runs (interpreted on a
    machine without a GPU: triton's functions decorated before the switch run interpreted too)."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    (tmp_path / "order.py").write_text(ORDER)   # triton reads a kernel's source from its file
    r = subprocess.run([sys.executable, "order.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
