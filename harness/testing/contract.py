"""The contract every registered kernel must pass, as a pytest test class made from its spec.

For each dtype: draw a problem, a layout, a seed and a valid config from the kernel's space; build random
inputs; give each tensor input its own layout (:func:`relayout_inputs`: a kernel that reads one input with
another's strides fails); poison the output with a NaN of its own bits; launch; compare with the float64
reference under the dtype's tolerance and check every element was written (an element still holding the
poison is reported apart from one written as NaN). Drawing the config as well as the problem tests every point the tuner
may pick, not only the default. Then the spec's own promises: the heuristic default is valid for any
problem, cached launch plans read each call's data, bad inputs are refused with a message, an explicit
invalid config is refused, and (on a GPU) the standard problems at full size match.

Budgets: the reference-match test runs at most ``examples`` hypothesis examples and stops launching once
``budget`` seconds are spent (a failure found before then is still shrunk in full); the ``slow``-marked
``test_matches_reference_deep`` runs the larger count with no time limit. Defaults: 12 examples and 120 s
through the interpreter, 40 examples and 5 s per (kernel, dtype) on a GPU; ``TRITUNE_EXAMPLES`` and
``TRITUNE_TEST_BUDGET`` override them.

Fast mode (``contract_tests(spec, fast=True)``, ``TRITUNE_CONTRACT_FAST=1`` or ``pytest --tritune-fast``), for
the interpreter: at most 6 examples and 20 s per dtype and no shrinking, so a failing kernel fails in seconds
with the first failing example (a full run shrinks it, minutes through the interpreter).
"""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings, strategies as st
from hypothesis.errors import FlakyStrategyDefinition

from tritune import kernels
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S
from tritune.testing import pytest_plugin

# Interpreter problems stay small: every program instance runs in Python.
MAX_ELEMS = S.cap(cpu=1 << 14, gpu=1 << 24)
DEEP_EXAMPLES = S.cap(cpu=40, gpu=300)
FAST_EXAMPLES, FAST_BUDGET = 6, 20.0


def _env_number(name: str, default, kind=float):
    v = os.environ.get(name)
    try:
        return kind(v) if v not in (None, "") else default
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected a number") from None


def default_examples() -> int:
    return _env_number("TRITUNE_EXAMPLES", S.cap(cpu=12, gpu=40), int)


def default_budget() -> float:
    # GPU: the ~27 (kernel, dtype) items of the fast suite and every other hypothesis test (tests/conftest.py
    # budgets them with this), each its budget plus one example's overrun, share 16 workers and the one GPU
    # with the engine tests; 5 s draws a few examples per item and run, afresh each run (the deep,
    # slow-marked variant has no time limit)
    return _env_number("TRITUNE_TEST_BUDGET", S.cap(cpu=120.0, gpu=5.0))


def fast_mode() -> bool:
    """``TRITUNE_CONTRACT_FAST=1`` or ``pytest --tritune-fast``: few examples, a short budget, no shrinking."""
    return (os.environ.get("TRITUNE_CONTRACT_FAST", "") not in ("", "0")) or pytest_plugin.fast_option()


def _settings(examples: int, fast: bool = False) -> settings:
    # derandomized through the interpreter (CI sees the same examples each run); on a GPU fresh examples
    # each run, a failing one replayed first from hypothesis's database
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([] if fast else [Phase.shrink])
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=dev.interpreted(), print_blob=True, phases=phases)


class BudgetSpent(BaseException):
    """A budgeted property test has used its time: the examples run so far passed."""


def ended_by_budget(exc: BaseException, state: dict) -> bool:
    """Whether ``exc``, out of a hypothesis run of a :func:`budgeted` body with ``state`` (its ``.state``),
    only says that the budget ended the run: no example failed."""
    if isinstance(exc, BudgetSpent):
        return True
    return isinstance(exc, FlakyStrategyDefinition) and state.get("spent", False) and not state["failed"]


def run_budgeted(test) -> None:
    """Run a hypothesis test whose body is :func:`budgeted`; a spent budget ends it as a pass."""
    try:
        test()
    except BaseException as e:  # noqa: BLE001 (re-raised unless the budget ended the run)
        state = getattr(getattr(getattr(test, "hypothesis", None), "inner_test", None), "state", {})
        if not ended_by_budget(e, state):
            raise


def budgeted(fn, budget: float | None, at_least: int = 2):
    """``fn`` that ends the hypothesis run once ``budget`` seconds have passed since its first call (after at
    least ``at_least`` runs), by raising :class:`BudgetSpent` (a ``BaseException``: no shrinking) before the
    example draws anything. Hypothesis may then report "inconsistent data generation" instead (an earlier
    example with the same prefix drew more): :func:`ended_by_budget` tells both apart from a failure, and
    :func:`run_budgeted` and the test suite's hook take them as a pass. After a failure the budget is off,
    so shrinking replays every example."""
    state = {"t0": None, "runs": 0, "failed": False, "spent": False}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        now = time.monotonic()
        if state["t0"] is None:
            state["t0"] = now
        if (budget is not None and not state["failed"] and state["runs"] >= at_least
                and now - state["t0"] > budget):
            state["spent"] = True
            raise BudgetSpent(f"{state['runs']} examples in {budget:.0f} s")
        state["runs"] += 1
        try:
            fn(*args, **kwargs)
        except BaseException:
            state["failed"] = True
            raise

    wrapper.state = state
    return wrapper


def _skip_if_interpreted(spec, dtype):
    if dev.interpreted() and dtype in spec.interpreter_skip:
        pytest.skip(f"GPU only: {spec.interpreter_skip[dtype]}")


def _dtype_id(d) -> str:
    return str(d).split(".")[-1]


def poison_out(case) -> None:
    outs = case.out if isinstance(case.out, (tuple, list)) else [case.out]
    for o in outs:
        if isinstance(o, torch.Tensor):
            cmp.poison(o)


def input_layouts(spec) -> list[str]:
    """What the contract may do to each tensor input on its own, within the layouts the spec accepts: keep
    it as ``make_inputs`` made it, pad its rows (``sliced``), flip its last two dims (``transposed``)."""
    return (["as made"] + (["padded"] if "sliced" in spec.layouts else [])
            + (["flipped", "flipped+padded"] if "transposed" in spec.layouts else []))


def relayout_inputs(spec, case, data) -> str:
    """Give each floating tensor input of ``case`` (positional or keyword, two dims or more) a layout of its
    own, drawn from :func:`input_layouts`: the same values in new strides, rows padded by a pad of its own,
    at an offset of its own (multiples of 16 bytes: alignment a kernel may require stays), NaN around. One
    layout for every input would let a kernel that reads one input with another's strides pass. Returns
    what it did, for the failure message."""
    choices = input_layouts(spec)
    if len(choices) == 1:
        return ""
    done, args = [], list(case.args)
    slots = [(i, t) for i, t in enumerate(args)] + list(case.kwargs.items())
    for n, (key, t) in enumerate(slots):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2):
            continue
        how = data.draw(st.sampled_from(choices), label=f"layout of input {key}")
        if how == "as made":
            continue
        new = S.restride(t, flip="flipped" in how, pad=3 + 2 * n if "padded" in how else 0,
                         offset=(1 + n) * max(16 // t.element_size(), 1))
        if isinstance(key, int):
            args[key] = new
        else:
            case.kwargs[key] = new
        done.append(f"{key}:{how}")
    case.args = tuple(args)
    return " ".join(done)


def check_matches_reference(spec, dtype, examples: int, budget: float | None, fast: bool = False) -> None:
    """The reference match over drawn problems, layouts (one per input), seeds and config points (None: the
    launcher's own choice: tuned store or heuristic default). ``fast``: no shrinking."""
    _skip_if_interpreted(spec, dtype)

    def prop(problem, layout, seed, data):
        points = spec.space.points(problem, dtype)
        assert points, f"{spec.name}: no valid config for {problem}"
        default = spec.default_config(problem, dtype)
        why = spec.space.why_invalid(default, problem, dtype)
        assert why is None, f"{spec.name}: default config {default} invalid for {problem}: {why}"
        config = data.draw(st.sampled_from([None] + points), label="config")
        case = spec.make_inputs(problem, dtype, dev.device(), seed, layout)
        inputs = relayout_inputs(spec, case, data)
        note(f"inputs relaid: {inputs or 'none'}")
        poison_out(case)
        got = spec.run(*case.args, out=case.out, config=config, **case.kwargs)
        ref = spec.reference(*case.args, **case.kwargs)
        cmp.check(got, ref, dtype, spec.accumulation(dtype),
                  what=f"{spec.name} {problem} {layout} {inputs} cfg={config}".replace("  ", " "))

    test = given(problem=spec.problems(MAX_ELEMS), layout=st.sampled_from(spec.layouts),
                 seed=st.integers(0, 2**31 - 1), data=st.data())(budgeted(prop, budget))
    run_budgeted(_settings(examples, fast)(test))


def check_cached_launch_plans(spec) -> None:
    """Launchers cache a plan per metadata: same-shaped calls with other data (and other outputs), in turn
    and again, must each match their own reference (a plan that kept a pointer, a copy or a workspace of the
    first call would not)."""
    usable = [d for d in spec.dtypes if d not in spec.interpreter_skip or not dev.interpreted()]
    if not usable:
        pytest.skip(f"{spec.name}: every dtype is GPU only")
    dtype = usable[0]
    acc = spec.accumulation(dtype)
    for problem in spec.small_problems[:2]:
        cases = [spec.make_inputs(problem, dtype, dev.device(), seed) for seed in (11, 12)]
        for case in cases + cases:
            poison_out(case)
            got = spec.run(*case.args, out=case.out, **case.kwargs)
            cmp.check(got, spec.reference(*case.args, **case.kwargs), dtype, acc, what=f"{spec.name} {problem}")
        got = spec.run(*cases[0].args, **cases[0].kwargs)  # a fresh output this time, same plan
        cmp.check(got, spec.reference(*cases[0].args, **cases[0].kwargs), dtype, acc)
        kernels.clear_config_cache()  # a store written meanwhile: plans must look their config up again
        got = spec.run(*cases[1].args, **cases[1].kwargs)
        cmp.check(got, spec.reference(*cases[1].args, **cases[1].kwargs), dtype, acc)


def check_default_config_valid(spec, examples: int = 150) -> None:
    """No launch, so problems of GPU size are cheap: the heuristic default must be a valid point of the
    space for every problem the strategy can draw (a missing default is a crash on a valid input)."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=dev.interpreted())
    @given(problem=spec.problems(1 << 26), dtype=st.sampled_from(spec.dtypes))
    def prop(problem, dtype):
        default = spec.default_config(problem, dtype)
        assert spec.space.why_invalid(default, problem, dtype) is None, (problem, dtype, default)

    prop()


def check_bad_inputs(spec) -> None:
    if spec.bad_inputs is None:
        pytest.skip(f"{spec.name} declares no bad inputs")
    for label, thunk, exc in spec.bad_inputs(dev.device()):
        with pytest.raises(exc) as info:
            thunk()
        assert str(info.value), f"{spec.name}: {label}: empty error message"


def check_spec_complete(spec) -> None:
    """Every standard and small problem has a valid default config, a bucket and a positive cost."""
    assert spec.small_problems, f"{spec.name}: no small problems (the interpreter's benchmark and tuning set)"
    for problem in spec.standard_problems + spec.small_problems:
        for dtype in spec.dtypes:
            cfg = spec.default_config(problem, dtype)
            assert spec.space.why_invalid(cfg, problem, dtype) is None, (problem, cfg)
            assert kernels.bucket_key(spec.bucket(problem))
            c = spec.cost(problem, dtype)
            assert c.bytes > 0 and c.flops >= 0, (problem, dtype, c)


def check_invalid_config_rejected(spec) -> None:
    problem = spec.small_problems[0]
    dtype = spec.dtypes[0]
    case = spec.make_inputs(problem, dtype, dev.device(), 0)
    bad = dict(spec.default_config(problem, dtype), not_a_parameter=1)
    with pytest.raises(ValueError, match="not_a_parameter"):
        spec.run(*case.args, out=case.out, config=bad, **case.kwargs)


def check_standard_problems(spec, dtype) -> None:
    """The benchmark problems themselves, at full size, with the default (or tuned) config."""
    if dev.interpreted():
        pytest.skip("needs a CUDA GPU (this machine runs kernels through the Triton interpreter)")
    for problem in spec.standard_problems:
        case = spec.make_inputs(problem, dtype, "cuda", 1234)
        poison_out(case)
        got = spec.run(*case.args, out=case.out, **case.kwargs)
        ref = spec.reference(*case.args, **case.kwargs)
        cmp.check(got, ref, dtype, spec.accumulation(dtype), what=f"{spec.name} {problem}")
        del case, got, ref
        torch.cuda.empty_cache()


def _mark(name: str):
    pytest_plugin.register_marker(name)
    return getattr(pytest.mark, name)


def contract_tests(spec, *, examples: int | None = None, budget: float | None = None,
                   fast: bool | None = None) -> type:
    """A pytest test class holding the whole contract for ``spec`` (a registered kernel's name or a
    :class:`~tritune.kernels.KernelSpec`). Assign it to a name starting with ``Test``::

        TestMyRMSNorm = contract_tests("my_rmsnorm")

    ``examples``: hypothesis examples per dtype for the reference match; ``budget``: seconds per dtype after
    which it stops launching (None: the defaults above); ``fast``: the fast mode above (None: on when
    ``TRITUNE_CONTRACT_FAST=1`` or ``--tritune-fast``, read when the test runs). The class is marked with the
    kernel's name (``-m``).
    """
    if isinstance(spec, str):
        spec = kernels.get(spec)
    if not isinstance(spec, kernels.KernelSpec):
        raise TypeError(f"spec: expected a kernel name or a KernelSpec, got {type(spec).__name__}")
    examples = default_examples() if examples is None else int(examples)
    budget = default_budget() if budget is None else budget

    def reference_match(dtype):
        quick = fast_mode() if fast is None else fast
        n, b = (min(examples, FAST_EXAMPLES), min(budget, FAST_BUDGET)) if quick else (examples, budget)
        check_matches_reference(spec, dtype, n, b, quick)
    dtypes = pytest.mark.parametrize("dtype", list(spec.dtypes), ids=[_dtype_id(d) for d in spec.dtypes])

    class Contract:
        __test__ = True

        @dtypes
        def test_matches_reference(self, dtype):
            reference_match(dtype)

        @pytest.mark.slow
        @dtypes
        def test_matches_reference_deep(self, dtype):
            check_matches_reference(spec, dtype, max(DEEP_EXAMPLES, examples), None)

        def test_cached_launch_plans_read_each_calls_data(self):
            check_cached_launch_plans(spec)

        def test_default_config_valid_for_any_problem(self):
            check_default_config_valid(spec)

        def test_bad_inputs_raise_clear_errors(self):
            check_bad_inputs(spec)

        def test_spec_is_complete(self):
            check_spec_complete(spec)

        def test_explicit_invalid_config_is_rejected(self):
            check_invalid_config_rejected(spec)

        @pytest.mark.gpu
        @pytest.mark.slow  # full-size problems against a float64 reference; bench checks them too
        @dtypes
        def test_standard_problems_on_gpu(self, dtype):
            check_standard_problems(spec, dtype)

    Contract.__name__ = Contract.__qualname__ = f"Test_{spec.name}"
    Contract.spec = spec
    Contract.pytestmark = [_mark(spec.name), _mark("tritune_contract")]
    return Contract
