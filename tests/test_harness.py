"""The harness must catch what it exists to catch."""
import time
import math

import pytest
import torch
from hypothesis import given

from tritune import kernels
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S


def test_wrong_kernel_fails_comparison():
    spec = kernels.get("gelu")
    case = spec.make_inputs(spec.small_problems[0], torch.float32, dev.device(), 0)
    ref = spec.reference(*case.args, **case.kwargs)
    wrong = torch.nn.functional.gelu(case.args[0], approximate="tanh")  # the other GELU: close, not equal
    with pytest.raises(AssertionError, match="FAIL"):
        cmp.check(wrong, ref, torch.float32)


def test_unwritten_element_is_caught():
    spec = kernels.get("layer_norm")
    case = spec.make_inputs(spec.small_problems[0], torch.float32, dev.device(), 0)
    ref = spec.reference(*case.args, **case.kwargs)
    out = ref.float().clone()
    cmp.poison(out[5:6, 3:4])
    c = cmp.compare(out, ref)
    assert c.unwritten == 1 and not c.ok


def test_nan_never_passes():
    ref = torch.randn(10, dtype=torch.float64)
    out = ref.clone()
    out[3] = float("nan")
    assert math.isinf(cmp.rel_error(out, ref))


def test_poison_integer_tensor():
    t = cmp.poison(torch.zeros(4, dtype=torch.int32))
    assert (t == torch.iinfo(torch.int32).max).all()


def test_tolerance_table_is_the_only_source():
    assert cmp.tolerance(torch.float32) < cmp.tolerance(torch.float16) < cmp.tolerance(torch.bfloat16)
    assert cmp.tolerance(torch.float32, "tf32") > cmp.tolerance(torch.float32)
    with pytest.raises(KeyError):
        cmp.tolerance(torch.int8)


@given(n=S.sizes(100))
def test_sizes_in_range(n):
    assert 1 <= n <= 100


@pytest.mark.parametrize("layout", S.LAYOUTS)
def test_layouts_keep_values(layout):
    t = torch.randn(7, 13)
    v = S.with_layout(t, layout)
    assert torch.equal(v, t)
    if layout == "transposed":
        assert v.stride() == (1, 7)
    if layout == "sliced":
        assert v.stride(0) > 13 and v.stride(1) == 1


def test_unknown_layout():
    with pytest.raises(ValueError, match="layout"):
        S.with_layout(torch.randn(3, 3), "diagonal")


def test_slug():
    assert dev.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_registry_discovers_kernels():
    names = {s.name for s in kernels.all_specs()}
    assert {"layer_norm", "gelu"} <= names
    with pytest.raises(KeyError, match="unknown kernel"):
        kernels.get("nope")


def test_bench_rows_carry_the_commit_measured(tmp_path, monkeypatch):
    """Each written row names the commit it measured: $TRITUNE_COMMIT where set (a tree copied to a GPU machine),
    a row's own commit kept when it has one (rows merged from another run)."""
    from tritune.harness import bench
    from tritune.tuning import timing

    monkeypatch.setenv("TRITUNE_COMMIT", "abc1234")
    row = {"kernel": "gelu", "problem": "M=1 N=1", "dtype": "float32", "ours_us": 1.0}
    path = bench.write_results([row, dict(row, problem="M=2 N=2", commit="0123456")], tmp_path, "gelu")
    import json

    assert [r["commit"] for r in json.loads(path.read_text())["rows"]] == ["abc1234", "0123456"]
    monkeypatch.delenv("TRITUNE_COMMIT")
    assert timing.source_commit() != "abc1234"


def test_bench_on_interpreter_checks_and_times(tmp_path):
    from tritune.harness import bench, report

    spec = kernels.get("gelu")
    rows = bench.bench_spec(spec, torch.float32, problems=spec.small_problems[:1])
    assert rows[0]["correct"] and rows[0]["ours_us"] > 0 and "vendor_us" in rows[0]
    path = bench.write_results(rows, tmp_path, "gelu")
    assert "gelu" in report.results_tables(tmp_path)
    assert path.exists()
    # a subset re-measured merges: its row replaces the same problem's, the others stay, each dated
    again = [dict(rows[0], ours_us=1.0)]
    bench.write_results(again + [dict(rows[0], problem="other")], tmp_path, "gelu", merge=True)
    bench.write_results([dict(rows[0], ours_us=2.0)], tmp_path, "gelu", merge=True)
    import json

    kept = json.loads(path.read_text())["rows"]
    assert [(r["problem"], r["ours_us"]) for r in kept] == [(rows[0]["problem"], 2.0), ("other", rows[0]["ours_us"])]
    assert all("measured" in r and "commit" in r for r in kept)
    # `tritune report`: docs/results.md in full, the README's headline table between its markers only
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{report.BEGIN}\nOLD TABLE\n{report.END}\nrest\n")
    from argparse import Namespace

    args = Namespace(results_dir=str(tmp_path), docs=str(tmp_path / "r.md"), readme=str(readme), print_only=False)
    assert report.run(args) == 0 and "gelu" in (tmp_path / "r.md").read_text()
    text = readme.read_text()
    assert "OLD TABLE" not in text and "vendor path" in text and text.startswith("intro") and text.endswith("rest\n")
    assert report.run(args) == 0 and readme.read_text() == text  # a second run changes nothing


def test_cli_info_and_bench(tmp_path, capsys):
    from tritune.harness import cli

    assert cli.main(["info"]) == 0
    assert "layer_norm" in capsys.readouterr().out
    assert cli.main(["bench", "gelu", "--dtype", "fp32", "--small", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gelu" in out
    assert ("interpreter" in out) == dev.interpreted()  # says so exactly when kernels are interpreted


def test_rel_error_infinities_must_match_the_reference():
    r = torch.tensor([1.0, -math.inf, 2.0])
    assert cmp.rel_error(r.clone(), r) == 0.0                                      # -inf where the reference has it
    assert cmp.rel_error(torch.tensor([1.0, math.inf, 2.0]), r) == math.inf        # wrong sign
    assert cmp.rel_error(torch.tensor([1.0, 0.0, 2.0]), r) == math.inf             # finite where -inf expected
    assert cmp.rel_error(torch.tensor([1.0, -math.inf, math.inf]), r) == math.inf  # inf where finite expected
    assert cmp.rel_error(torch.tensor([math.nan, -math.inf, 2.0]), r) == math.inf  # NaN never passes


def test_time_rounds_alternates_and_takes_medians(monkeypatch):
    """Short problems: ours, the vendor and each peer in alternating rounds (three here), each path's median; a
    failing peer is reported and dropped; long problems and the interpreter: one round."""
    from tritune.harness import bench

    seq = {"ours": [0.05, 0.20, 0.06], "vendor": [0.07, 0.07, 0.30], "bad": []}
    order = []

    def fake_median_ms(fn):
        order.append(fn)
        if fn == "bad":
            raise RuntimeError("peer down")
        return seq[fn][sum(1 for o in order if o == fn) - 1]

    assert bench.ROUNDS_SHORT % 2 == 1  # an odd count: each path's median is one of its rounds
    monkeypatch.setattr(bench, "ROUNDS_SHORT", 3)
    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    monkeypatch.setattr(bench.dev, "interpreted", lambda: False)
    out, rounds = bench.time_rounds({"ours": "ours", "vendor": "vendor", "bad": "bad"})
    assert rounds == 3
    assert order == ["ours", "vendor", "bad", "ours", "vendor", "ours", "vendor"]
    assert out["ours"] == 0.06 and out["vendor"] == 0.07 and "peer down" in out["bad"]
    seq["ours"] = [0.5]
    order.clear()
    out, rounds = bench.time_rounds({"ours": "ours"})
    assert rounds == 1 and out == {"ours": 0.5}


@pytest.mark.parametrize("argv,needle", [
    (["bench", "no_such_kernel"], "unknown kernel 'no_such_kernel'"),
    (["tune", "no_such_kernel", "--trials", "1"], "unknown kernel 'no_such_kernel'"),
    (["configs", "no_such_kernel"], "unknown kernel 'no_such_kernel'"),
    (["bench", "gelu", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["bench", "gelu", "--results-dir", __file__], "is a file, not a folder"),
    (["report", "--results-dir", "/no/such/folder"], "no such folder"),
    (["plot", "--results-dir", "/no/such/folder"], "no such folder"),
    (["--plugin", "no_such_plugin_module", "info"], "no module named 'no_such_plugin_module'"),
    (["--plugin", "/no/such/plugin.py", "bench", "gelu"], "no such file"),
    (["bench", "gelu", "--problems", "M=1"], "no field 'M'"),
    (["frobnicate"], "invalid choice"),
    # numbers out of range are refused by value before any work (a negative count ran into an IndexError, a
    # negative patience tuned until killed)
    (["serve-bench", "-n", "-3"], "-n/--num-requests: expected an integer >= 1, got -3"),
    (["serve-bench", "--max-batch-tokens", "0"], "--max-batch-tokens: expected an integer >= 1, got 0"),
    (["serve-bench", "--rate", "-1"], "--rate: expected a positive number, got '-1'"),
    (["serve-bench", "--kv-memory-fraction", "2"], "expected a fraction in (0, 1]"),
    (["serve-bench", "--block-size", "3"], "--block-size: expected a power of two in [1, 256], got 3"),
    (["tune", "gelu", "--budget", "1m", "--patience", "-1"], "--patience: expected an integer >= 1, got -1"),
    (["tune", "gelu", "--min-gain", "nan"], "--min-gain: expected a finite number >= 0, got 'nan'"),
    (["bench", "gelu", "--rounds", "1"], "--rounds: expected an integer >= 2, got 1"),
    (["profile", "--top", "0", "generate", "hi"], "--top: expected an integer >= 1, got 0"),
])
def test_cli_misuse_is_one_line_and_exit_2(argv, needle, capsys, monkeypatch):
    from tritune.harness import cli

    monkeypatch.delenv("TRITUNE_PLUGINS", raising=False)
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors (one line too: cli.Parser)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_has_no_import_cycle_with_tuning():
    """tuning/cli plugs into harness/cli; it must not import it back (nor must the model's commands)."""
    import pathlib

    import tritune.harness.cli as hc

    root = pathlib.Path(hc.__file__).parent.parent
    for f in [root / "tuning" / "cli.py", root / "model" / "serve.py", root / "model" / "server.py",
              root / "model" / "eval.py"]:
        if f.exists():
            assert "tritune.harness.cli" not in f.read_text(), f


def test_hypothesis_time_budget_stops_launching_but_still_shrinks():
    from hypothesis import given, settings, strategies as st

    from tritune.testing.contract import budgeted, run_budgeted

    ran = []

    def prop(n):
        ran.append(n)

    wrapped = budgeted(prop, budget=0.0, at_least=3)
    run_budgeted(settings(max_examples=50, database=None)(given(st.integers(0, 100))(wrapped)))
    assert len(ran) == 3  # after the budget the run ends (no example returns without its draws: flaky data)

    def failing(n):
        assert n < 50

    # found within the examples the budget allows; then the budget is off, so shrinking replays every example
    # (were it not, the replays would pass and hypothesis would call the test flaky)
    with pytest.raises(AssertionError):
        settings(max_examples=200, database=None, derandomize=True)(
            given(st.integers(0, 100))(budgeted(failing, 0.0, 30)))()


def test_a_budget_spent_on_a_small_domain_is_a_pass_not_flaky_data():
    """Hypothesis replays prefixes it has seen: an example the budget stops before its draws, at a prefix an
    earlier example drew past, is "inconsistent data generation" to it. That ending is still the budget's."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from tritune.testing.contract import budgeted, run_budgeted

    def prop(x, data):
        data.draw(st.integers(0, 10))
        time.sleep(0.005)

    for budget in (0.0, 0.02, 0.05, 0.1):
        test = given(x=st.integers(0, 3), data=st.data())(budgeted(prop, budget))
        run_budgeted(settings(max_examples=200, deadline=None, database=None,
                              suppress_health_check=list(HealthCheck))(test))


def test_unwritten_is_told_apart_from_written_nan():
    ref = torch.randn(4, 6, dtype=torch.float64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = cmp.poison(torch.empty(6, 4, dtype=dtype)).t()      # a transposed output keeps the poison's bits
        out[:3] = ref[:3].to(dtype)
        out[3, :2] = float("nan")                                  # a kernel that computed NaN there
        c = cmp.compare(out, ref)
        assert (c.unwritten, c.nan, c.ok) == (4, 2, False), (dtype, c)
        assert "4 unwritten (still the poison), 2 written as NaN" in str(c)


def test_restride_keeps_values_and_gives_each_input_its_own_strides():
    t = torch.randn(3, 5, 7)
    for kw in ({}, {"flip": True}, {"pad": 3, "offset": 4}, {"flip": True, "pad": 5, "offset": 8}):
        v = S.restride(t, **kw)
        assert torch.equal(v, t) and v.storage_offset() == kw.get("offset", 0), kw
    assert S.restride(t, flip=True).stride() == (35, 1, 5) and S.restride(t, pad=3).stride() == (50, 10, 1)
    tt = torch.randn(6, 4).t()                                     # a transposed view stays transposed
    assert S.restride(tt, pad=2).stride() == (1, 6)


# A two-input kernel, out = x + y over (M, N): the buggy one loads y with x's strides, right whenever both
# inputs share a layout. The contract must catch it: each input gets a layout of its own.
_ADD_SRC = '''
import triton, triton.language as tl

@triton.jit
def add_kernel(X, Y, O, M, N, sxm, sxn, sym, syn, som, son, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(X + r * sxm + c * sxn, mask=m)
    y = tl.load(Y + r * sym + c * syn, mask=m)
    tl.store(O + r * som + c * son, x + y, mask=m)
'''


def _add_spec(buggy: bool, folder):
    import dataclasses
    import importlib.util

    import triton
    from hypothesis import strategies as st

    # a real file: Triton's compiler (not the interpreter) reads a kernel's source with inspect
    path = folder / "tritune_test_add.py"
    path.write_text(_ADD_SRC)
    spec = importlib.util.spec_from_file_location("tritune_test_add", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    P = dataclasses.make_dataclass("P", [("m", int), ("n", int)], frozen=True)

    def run(x, y, *, out=None, config=None):
        out = torch.empty_like(x) if out is None else out
        sy = x.stride() if buggy else y.stride()
        mod.add_kernel[(x.shape[0],)](x, y, out, *x.shape, *x.stride(), *sy, *out.stride(),
                                      BLOCK=triton.next_power_of_2(x.shape[1]))
        return out

    def make_inputs(p, dtype, device, seed, layout="contiguous"):
        x, y = (S.with_layout(S.randn((p.m, p.n), dtype, device, seed + i), layout) for i in (0, 1))
        return kernels.Case(args=(x, y), out=torch.empty(p.m, p.n, dtype=dtype, device=device))

    return kernels.KernelSpec(
        name="test_add_buggy" if buggy else "test_add", run=run, reference=lambda x, y: x.double() + y.double(),
        make_inputs=make_inputs, problems=lambda cap: st.builds(P, st.integers(2, 9), st.integers(2, 12)),
        space=kernels.Space({"X": [1]}), default_config=lambda p, d: {"X": 1}, bucket=lambda p: {"m": p.m},
        cost=lambda p, d: kernels.Cost(p.m * p.n, 12 * p.m * p.n), problem_of=lambda x, y: P(*x.shape),
        standard_problems=[P(64, 64)], small_problems=[P(4, 5)], dtypes=(torch.float32,),
        layouts=("contiguous", "sliced", "transposed"))


def test_contract_catches_a_kernel_that_reads_one_input_with_anothers_strides(tmp_path):
    from tritune.testing.contract import check_matches_reference

    check_matches_reference(_add_spec(False, tmp_path), torch.float32, examples=6, budget=None, fast=True)
    with pytest.raises(AssertionError, match="FAIL"):
        check_matches_reference(_add_spec(True, tmp_path), torch.float32, examples=6, budget=None, fast=True)


def test_cli_test_help_leads_with_tritunes_options():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from tritune.harness.cli import main; main(['test', '--help'])"],
                       capture_output=True, text=True, timeout=120)
    head = r.stdout[:1500]
    assert r.returncode == 0 and head.startswith("usage: tritune test"), r.stdout[:500] + r.stderr[-2000:]
    assert "--tritune-fast" in head and "TRITUNE_CONTRACT_FAST" in head and "pytest's options follow" in head


def test_contract_fast_mode_switch(monkeypatch):
    from tritune.testing import contract

    monkeypatch.delenv("TRITUNE_CONTRACT_FAST", raising=False)
    assert not contract.fast_mode()
    monkeypatch.setenv("TRITUNE_CONTRACT_FAST", "1")
    assert contract.fast_mode()
    fast = contract._settings(6, fast=True)
    assert fast.max_examples == 6 and "shrink" not in {p.name for p in fast.phases}
    assert "shrink" in {p.name for p in contract._settings(6).phases}


def test_bench_rows_put_each_paths_graph_time_beside_ours(monkeypatch):
    """The vendor path and the peers replayed from a CUDA graph too (a ratio to ours in the same mode);
    one that cannot be captured says so; one that did not time is left out."""
    from tritune.harness import bench

    spec = kernels.get("layer_norm")
    problem = spec.small_problems[0]
    graph = {"ours": 0.010, "vendor": 0.015}

    def fake_graph_ms(fn):
        if fn.name not in graph:
            raise RuntimeError("operation not permitted when stream is capturing")
        return graph[fn.name]

    def path(name):
        def fn():
            return None
        fn.name = name
        return fn

    dev.ceilings()   # measured (on a GPU) before synchronize is stubbed out: the roofline column reads them
    monkeypatch.setattr(bench, "graph_ms", fake_graph_ms)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    row = {}
    paths = {n: path(n) for n in ("ours", "vendor", "liger", "broken")}
    bench.graph_columns(row, spec, problem, torch.float32, paths,
                        {"vendor": 0.02, "liger": 0.03, "broken": "RuntimeError: no"})
    assert row["graph_us"] == pytest.approx(10.0) and "pct_roofline_graph" in row
    assert row["vendor_graph_us"] == pytest.approx(15.0) and row["vs_vendor_graph"] == pytest.approx(1.5)
    assert "capturing" in row["liger_graph_error"] and "vs_liger_graph" not in row
    assert not any(k.startswith("broken_graph") for k in row)
