"""tritune profile: the per-kernel table and the host gaps from kernel records; ncu's CSV; the refusal
without a GPU. (On a GPU the command itself runs in the benchmark drivers: profiles are measurements.)"""
import subprocess
import sys

import pytest
import torch

from tritune.harness import profiling as P


def test_table_counts_shares_gaps_and_ours():
    ev = [P.KernelEvent("_gemm_kernel", 0, 10), P.KernelEvent("ampere_sgemm", 5, 10),   # overlap 5 us
          P.KernelEvent("_gemm_kernel", 30, 10), P.KernelEvent("_ln_fwd", 50, 20)]
    rows, s = P.kernel_table(ev, {"_gemm_kernel", "_ln_fwd"})
    by = {r["kernel"]: r for r in rows}
    assert by["_gemm_kernel"]["calls"] == 2 and by["_gemm_kernel"]["total_us"] == 20
    assert by["_gemm_kernel"]["mean_us"] == 10 and by["_gemm_kernel"]["tritune"]
    assert not by["ampere_sgemm"]["tritune"]
    assert s["span_us"] == 70 and s["busy_us"] == 15 + 10 + 20 and s["gap_us"] == 25
    assert s["tritune_share"] == pytest.approx(40 / 50)
    assert rows[0]["kernel"] == "_gemm_kernel" and sum(r["share"] for r in rows) == pytest.approx(1)


def test_tritune_names_are_the_registered_kernels_jitted_functions():
    names = P.tritune_kernel_names()
    assert names and all(isinstance(n, str) for n in names)
    from tritune.kernels import layer_norm

    jitted = [v.fn.__name__ for v in vars(layer_norm).values() if callable(getattr(v, "fn", None))]
    assert jitted and set(jitted) <= names


def test_ncu_csv_is_averaged_per_kernel():
    text = ('==PROF== noise\n"ID","Kernel Name","gpu__time_duration.sum","dram__bytes.sum","launch__registers_per_thread"\n'
            '"","","nsecond","byte","register/thread"\n'
            '"0","_gemm_kernel","1,000","4000","128"\n"1","_gemm_kernel","3,000","8000","128"\n')
    (r,) = P.parse_ncu_csv(text)
    assert r["kernel"] == "_gemm_kernel" and r["launches"] == 2
    assert r["duration_ns"] == 2000 and r["dram_bytes"] == 6000 and r["registers"] == 128


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_profile_without_a_gpu_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "tritune.harness.cli", "profile", "generate", "x"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "CUDA GPU" in p.stderr


def test_regression_gate_reads_files_folders_and_revisions(tmp_path):
    import json

    from tritune.harness import regress

    rows = {"rows": [{"kernel": "layer_norm", "problem": "M=64 N=768 affine=True", "dtype": "bfloat16",
                      "config": {"BLOCK_N": 128, "ROWS": 4, "num_warps": 2}},
                     {"kernel": "layer_norm", "problem": "M=1 N=8", "dtype": "bfloat16"}]}   # no config: skipped
    f = tmp_path / "layer_norm.json"
    f.write_text(json.dumps(rows))
    assert len(regress.load_baseline(str(f), "gpu", ["layer_norm"])["layer_norm"]) == 1
    assert len(regress.load_baseline(str(tmp_path), "gpu", ["layer_norm"])["layer_norm"]) == 1
    got = regress.load_baseline("HEAD", "nvidia-h200", ["layer_norm"])["layer_norm"]   # the committed rows
    assert got and all(r["config"] for r in got)
    with pytest.raises(ValueError, match="--compare"):
        regress.load_baseline("no-such-revision-or-file", "gpu", ["layer_norm"])


def test_noise_is_the_scatter_of_the_per_round_ratios():
    from tritune.harness import regress

    assert regress.scatter([1.0, 1.0, 1.0]) == 0
    assert regress.scatter([0.9, 1.0, 1.1, 1.0, 1.0]) == 0
    assert regress.scatter([0.9, 1.0, 1.1]) == pytest.approx(0.1)


@pytest.mark.parametrize("slow,want", [(1.0, False), (1.02, False), (2.0, True)])
def test_the_gate_times_both_configs_by_the_tuners_timer_and_flags_only_a_real_slowdown(monkeypatch, slow, want):
    """Each round times today's lookup and the baseline row's config through tuning.timing (graph replay
    over rotating inputs on a GPU); a drift common to a round cancels in its ratio."""
    import itertools

    from tritune import kernels
    from tritune.harness import regress
    from tritune.tuning import timing

    spec = kernels.get("layer_norm")
    problem = spec.small_problems[0]
    dtype = torch.float32
    base_cfg = spec.default_config(problem, dtype)
    made, modes = [], []
    real_cycling = timing.cycling

    def cycling(cases, make_call):      # the first callable made is today's config, the second the baseline's
        call = real_cycling(cases, make_call)
        call.now = not made
        made.append(call)
        return call

    drift = itertools.cycle([1.0, 1.0, 1.3, 1.3, 0.8, 0.8, 1.1, 1.1, 0.9, 0.9])   # per round, both configs

    def time_ms(fn, mode):
        modes.append(mode)
        fn()                             # the launch itself runs (the interpreter here)
        return 0.01 * next(drift) * (slow if fn.now else 1.0)

    monkeypatch.setattr(timing, "cycling", cycling)
    monkeypatch.setattr(timing, "time_ms", time_ms)
    monkeypatch.setattr(spec, "config_for", lambda *a, **k: dict(base_cfg))
    row = {"problem": str(problem), "dtype": "float32", "config": base_cfg}
    v = regress.compare_row(spec, row, problem, dtype, rounds=5, min_slowdown=0.03)
    assert v.slower is want and v.ratio == pytest.approx(slow) and v.noise == pytest.approx(0.0)
    assert v.same_config and len(modes) == 10 and set(modes) == {timing.timing_mode(spec, problem, dtype)}


def test_events_are_read_from_kinetos_records_as_the_profilers_own_list():
    """The kernel records come from kineto's raw events (fast for a serving run's million), the same names
    and durations as ``prof.events()`` lists (host ops stand in for kernels on a machine without a GPU)."""
    from torch.autograd import DeviceType

    x = torch.randn(32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            x = x * 1.0001
    got = P.events_of(prof, DeviceType.CPU)
    want = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    assert sorted(e.name for e in got) == sorted(e.name for e in want) and len(got) >= 50
    assert abs(sum(e.dur_us for e in got) - sum(e.time_range.elapsed_us() for e in want)) <= 0.01 * len(want) + 1
