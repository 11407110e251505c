"""Tuning on a miss (tuning/on_miss.py), on the interpreter: gelu on a tiny problem, a few trials each.

A miss tunes once and stores the winner in the user store; the next launch (a fresh config cache, or another
process) uses it without tuning; two processes at once tune the bucket once; off by default; a study that
finds nothing leaves the default with a warning; never while tracing.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tritune import kernels as K
from tritune.kernels import gelu as gelu_mod
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import spec as spec_mod
from tritune.kernels.runtime import store
from tritune.tuning import on_miss
from tritune.tuning.runners import InlineRunner

PROBLEM = gelu_mod.Problem(1021, "tanh")        # bucket numel=1024,approximate=tanh
BUCKET = K.bucket_key(gelu_mod.bucket(PROBLEM))


@pytest.fixture
def miss_env(tmp_path, monkeypatch):
    """Empty stores, a study journal and a cache of the test's own; tuning on a miss off until a test
    switches it on; nothing remembered from another test."""
    (tmp_path / "packaged").mkdir()
    for k, v in {"TRITUNE_CONFIGS": tmp_path / "packaged", "TRITUNE_CONFIG_DIR": tmp_path / "user",
                 "TRITUNE_STUDIES": tmp_path / "s.journal", "TRITUNE_CACHE": tmp_path / "cache",
                 "TRITUNE_TUNE_ON_MISS_TRIALS": "3", "TRITUNE_TUNE_ON_MISS_BUDGET": "120"}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("TRITUNE_TUNE_ON_MISS", raising=False)
    monkeypatch.delenv("TRITUNE_GPU_SLUG", raising=False)

    def reset():
        on_miss.HANDLED.clear()
        store.clear_cache()
        gelu_mod._PLANS.clear()

    reset()
    with spec_mod.set_tune_on_miss(None):
        yield tmp_path
    reset()


def launch():
    x = torch.randn(1021, dtype=torch.float32, device=dev.device())
    y = gelu_mod.gelu(x, "tanh")
    torch.testing.assert_close(y.double(), torch.nn.functional.gelu(x.double(), approximate="tanh"),
                               rtol=1e-5, atol=1e-5)
    return K.CONFIG_CACHE.get(gelu_mod.SPEC.config_key(PROBLEM, torch.float32))


def user_entries(tmp_path):
    p = tmp_path / "user" / dev.gpu_slug() / "gelu.json"
    return json.loads(p.read_text())["entries"] if p.exists() else []


def test_a_miss_tunes_once_stores_the_winner_and_the_next_launch_uses_it(miss_env, capsys, monkeypatch):
    with spec_mod.set_tune_on_miss(True):
        cfg = launch()
        err = capsys.readouterr().err
        assert f"tritune: tuning gelu bucket {BUCKET} float32" in err and "stored, " in err and "x the default" in err
        (e,) = user_entries(miss_env)
        assert (e["bucket"], e["dtype"], e["config"]) == (BUCKET, "float32", cfg)
        assert e["trials"] == 3 and e["default_us"] is not None

        # a fresh process's view: nothing remembered, the config cache empty; the store answers, no study runs
        on_miss.HANDLED.clear()
        K.clear_config_cache()
        monkeypatch.setattr(on_miss, "run", lambda *a, **k: pytest.fail("tuned a bucket that is stored"))
        assert launch() == cfg
        assert "tuning" not in capsys.readouterr().err
    assert not spec_mod.tune_on_miss()   # the context manager put the setting back


def test_off_by_default(miss_env, monkeypatch):
    called = []
    monkeypatch.setitem(spec_mod.MISS, "handler", lambda *a: called.append(a) or (None, True))
    assert not spec_mod.tune_on_miss()
    assert launch() == gelu_mod.default_config(PROBLEM, torch.float32)
    assert not called and not user_entries(miss_env)
    with spec_mod.set_tune_on_miss(True):   # switched on: a bucket launched untuned before misses again
        launch()
    assert len(called) == 1
    monkeypatch.setenv("TRITUNE_TUNE_ON_MISS", "1")   # the env var switches it on
    K.clear_config_cache()
    launch()
    assert len(called) == 2


def test_a_failing_study_falls_back_to_the_default_with_a_warning(miss_env, monkeypatch):
    monkeypatch.setattr(on_miss, "make_runner",
                        lambda *a, **k: InlineRunner(lambda task: {"ok": False, "error": "compile error: boom"}))
    with spec_mod.set_tune_on_miss(True), pytest.warns(UserWarning, match="no verified config .*compile error"):
        cfg = launch()
    assert cfg == gelu_mod.default_config(PROBLEM, torch.float32)
    assert not user_entries(miss_env)


def test_never_tunes_while_tracing_and_asks_again_after(miss_env, monkeypatch):
    monkeypatch.setattr(on_miss, "tracing", lambda: True)
    monkeypatch.setattr(on_miss, "run", lambda *a, **k: pytest.fail("tuned while tracing"))
    with spec_mod.set_tune_on_miss(True):
        assert launch() is None   # launched with the default, and not kept: the next launch asks again


def test_a_malformed_budget_names_the_variable(miss_env, monkeypatch):
    monkeypatch.setenv("TRITUNE_TUNE_ON_MISS_BUDGET", "soon")
    with spec_mod.set_tune_on_miss(True), pytest.raises(ValueError, match="TRITUNE_TUNE_ON_MISS_BUDGET"):
        launch()


TWO = r"""
import os, sys, time
import torch
from tritune.kernels import gelu
from tritune.kernels.runtime import device as dev
rv, me = sys.argv[1], sys.argv[2]
open(os.path.join(rv, me), "w").close()
while len(os.listdir(rv)) < 2:   # both imported: launch together
    time.sleep(0.05)
from tritune import kernels as K
gelu.gelu(torch.randn(1021, device=dev.device()), "tanh")
print("CONFIG", K.CONFIG_CACHE[gelu.SPEC.config_key(gelu.Problem(1021, "tanh"), torch.float32)])
"""


def test_two_processes_at_once_tune_the_bucket_once(miss_env):
    rv = miss_env / "rendezvous"
    rv.mkdir()
    env = dict(os.environ, TRITUNE_TUNE_ON_MISS="1")
    procs = [subprocess.Popen([sys.executable, "-c", TWO, str(rv), str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    errs = [err for _, err in outs]
    assert sum("stored, " in e for e in errs) == 1, errs    # one process tuned it ...
    # ... the other waited for it and reused its entry (or, arriving later, found the entry at once)
    assert sum("another process tuned it" in e or "tritune: tuning" not in e for e in errs) == 1, errs
    configs = {next(ln for ln in out.splitlines() if ln.startswith("CONFIG")) for out, _ in outs}
    assert len(configs) == 1
    (e,) = user_entries(miss_env)
    assert e["trials"] == 3
