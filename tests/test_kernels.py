"""Property tests for every registered kernel, generated from its spec (no per-kernel branches).

For each kernel and dtype: draw a problem, a layout, a seed and a valid config from the kernel's space;
build random inputs; poison the output; launch; compare with the float64 reference under the dtype's
tolerance and check every element was written. Drawing the config as well as the problem tests every
point the tuner may pick, not only the default.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tritune import kernels
from tritune.harness import compare as cmp
from tritune.harness import device as dev
from tritune.harness import strategies as S

SPECS = kernels.all_specs()
CASES = [pytest.param(s, d, id=f"{s.name}-{str(d).split('.')[-1]}") for s in SPECS for d in s.dtypes]
# Interpreter problems stay small: every program instance runs in Python.
MAX_ELEMS = S.cap(cpu=1 << 14, gpu=1 << 24)


def _skip_if_interpreted(spec, dtype):
    if dev.interpreted() and dtype in spec.interpreter_skip:
        pytest.skip(f"GPU only: {spec.interpreter_skip[dtype]}")


def _poison_out(case):
    outs = case.out if isinstance(case.out, (tuple, list)) else [case.out]
    for o in outs:
        cmp.poison(o)


@pytest.mark.parametrize("spec,dtype", CASES)
def test_matches_reference(spec, dtype):
    _skip_if_interpreted(spec, dtype)

    @given(problem=spec.problems(MAX_ELEMS), layout=st.sampled_from(spec.layouts),
           seed=st.integers(0, 2**31 - 1), data=st.data())
    def prop(problem, layout, seed, data):
        points = spec.space.points(problem, dtype)
        assert points, f"{spec.name}: no valid config for {problem}"
        default = spec.default_config(problem, dtype)
        assert spec.space.why_invalid(default, problem, dtype) is None, \
            f"default config {default} invalid: {spec.space.why_invalid(default, problem, dtype)}"
        config = data.draw(st.sampled_from([None] + points), label="config")
        case = spec.make_inputs(problem, dtype, dev.device(), seed, layout)
        _poison_out(case)
        got = spec.run(*case.args, out=case.out, config=config, **case.kwargs)
        ref = spec.reference(*case.args, **case.kwargs)
        cmp.check(got, ref, dtype, spec.accumulation(dtype), what=f"{spec.name} {problem} {layout} cfg={config}")

    prop()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_cached_launch_plans_read_each_calls_data(spec):
    """Launchers cache a plan per metadata: same-shaped calls with other data (and other outputs), in
    turn and again, must each match their own reference (a plan that kept a pointer, a copy or a
    workspace of the first call would not)."""
    dtype = next(d for d in spec.dtypes if d not in spec.interpreter_skip or not dev.interpreted())
    for problem in spec.small_problems[:2]:
        cases = [spec.make_inputs(problem, dtype, dev.device(), seed) for seed in (11, 12)]
        for case in cases + cases:
            _poison_out(case)
            got = spec.run(*case.args, out=case.out, **case.kwargs)
            cmp.check(got, spec.reference(*case.args, **case.kwargs), dtype, spec.accumulation(dtype),
                      what=f"{spec.name} {problem}")
        got = spec.run(*cases[0].args, **cases[0].kwargs)  # a fresh output this time, same plan
        cmp.check(got, spec.reference(*cases[0].args, **cases[0].kwargs), dtype, spec.accumulation(dtype))
        kernels.clear_config_cache()  # a store written meanwhile: plans must look their config up again
        got = spec.run(*cases[1].args, **cases[1].kwargs)
        cmp.check(got, spec.reference(*cases[1].args, **cases[1].kwargs), dtype, spec.accumulation(dtype))


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_default_config_valid_for_any_problem(spec):
    """No launch, so problems of GPU size are cheap: the heuristic default must be a valid point of the
    space for every problem the strategy can draw (a missing default is a crash on a valid input)."""

    @settings(max_examples=150, deadline=None)
    @given(problem=spec.problems(1 << 26), dtype=st.sampled_from(spec.dtypes))
    def prop(problem, dtype):
        default = spec.default_config(problem, dtype)
        assert spec.space.why_invalid(default, problem, dtype) is None, (problem, dtype, default)

    prop()


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_bad_inputs_raise_clear_errors(spec):
    if spec.bad_inputs is None:
        pytest.skip(f"{spec.name} declares no bad inputs")
    for label, thunk, exc in spec.bad_inputs(dev.device()):
        with pytest.raises(exc) as info:
            thunk()
        assert str(info.value), f"{spec.name}: {label}: empty error message"


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_spec_is_complete(spec):
    """Every standard problem has a valid default config, a bucket and a positive cost."""
    for problem in spec.standard_problems + spec.small_problems:
        for dtype in spec.dtypes:
            cfg = spec.default_config(problem, dtype)
            assert spec.space.why_invalid(cfg, problem, dtype) is None, (problem, cfg)  # so the space is not empty
            assert kernels.bucket_key(spec.bucket(problem))
            c = spec.cost(problem, dtype)
            assert c.bytes > 0 and c.flops >= 0


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_explicit_invalid_config_is_rejected(spec):
    problem = spec.small_problems[0]
    dtype = spec.dtypes[0]
    case = spec.make_inputs(problem, dtype, dev.device(), 0)
    bad = dict(spec.default_config(problem, dtype), not_a_parameter=1)
    with pytest.raises(ValueError, match="not_a_parameter"):
        spec.run(*case.args, out=case.out, config=bad, **case.kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("spec,dtype", CASES)
def test_standard_problems_on_gpu(spec, dtype):
    """The benchmark problems themselves, at full size, with the default (or tuned) config."""
    for problem in spec.standard_problems:
        case = spec.make_inputs(problem, dtype, "cuda", 1234)
        _poison_out(case)
        got = spec.run(*case.args, out=case.out, **case.kwargs)
        ref = spec.reference(*case.args, **case.kwargs)
        cmp.check(got, ref, dtype, spec.accumulation(dtype), what=f"{spec.name} {problem}")
        del case, got, ref
        torch.cuda.empty_cache()
