"""`tritune report` marks kernel rows that regressed against the committed baseline (a git repository made
in tmp_path); `tritune plot` draws the Nsight Compute counters of profile.json. On the CPU, no GPU needed."""
import json
import subprocess

import pytest

from tritune.harness import report


def git(repo, *argv):
    return subprocess.run(["git", *argv], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def rows(times: dict, noise: dict | None = None) -> dict:
    out = []
    for problem, us in times.items():
        r = {"kernel": "gelu", "problem": problem, "dtype": "bfloat16", "ours_us": us, "correct": True}
        if noise and problem in noise:
            r["noise"] = noise[problem]
        out.append(r)
    return {"environment": {"gpu": "NVIDIA H200"}, "rows": out}


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "results" / "nvidia-h200").mkdir(parents=True)
    return tmp_path


def commit(repo, data: dict, msg: str) -> str:
    (repo / "results" / "nvidia-h200" / "gelu.json").write_text(json.dumps(data))
    git(repo, "add", "results")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "--short", "HEAD")


BASE = {"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.0}


def test_regressions_beyond_noise_or_five_percent():
    base = rows(BASE, noise={"c": 0.10})["rows"]
    now = rows({"a": 10.4, "b": 10.6, "c": 10.9, "d": 11.5}, noise={"d": 0.20})["rows"]
    got = report.regressions(now, base)
    # a: +4% (under 5%); b: +6%; c: +9% within its recorded 10%; d: +15% within the new row's 20%
    assert set(got) == {("b", "bfloat16")}
    assert got[("b", "bfloat16")].limit == pytest.approx(0.05)
    # rows without a time on one side, and other dtypes, are not compared
    now[1]["error"] = "boom"
    assert report.regressions(now, base) == {}


def test_report_marks_rows_slower_than_the_previous_commit(repo):
    first = commit(repo, rows(BASE), "baseline")
    second = commit(repo, rows({"a": 10.1, "b": 12.0, "c": 9.0, "d": 10.0}), "slower b")
    assert report.baseline_rows(repo / "results" / "nvidia-h200" / "gelu.json")[0] == first
    text = report.results_tables(repo / "results", configs_dir=repo / "none")
    marked = [ln for ln in text.splitlines() if "↓" in ln]
    assert len(marked) == 2 and "| b " in marked[0], text    # the row, then the footnote's head
    assert f"slower than at `{first}`" in text and "- b bfloat16: 10.0 → 12.0 µs (+20.0%" in text

    # results not yet committed: the last commit is the baseline
    (repo / "results" / "nvidia-h200" / "gelu.json").write_text(
        json.dumps(rows({"a": 10.1, "b": 12.0, "c": 11.0, "d": 10.0})))
    assert report.baseline_rows(repo / "results" / "nvidia-h200" / "gelu.json")[0] == second
    text = report.results_tables(repo / "results", configs_dir=repo / "none")
    assert "- c bfloat16: 9.0 → 11.0" in text and "- b bfloat16" not in text

    # --baseline REV; docs/results.md written by `tritune report`
    docs = repo / "docs" / "results.md"
    args = type("A", (), dict(results_dir=str(repo / "results"), docs=str(docs), readme=str(repo / "README.md"),
                              print_only=False, baseline=first))()
    assert report.run(args) == 0
    out = docs.read_text()
    assert f"slower than at `{first}`" in out and "- b bfloat16: 10.0 → 12.0" in out
    assert "- c bfloat16: 10.0 → 11.0" in out    # against the first commit, c is 10% slower too
    args.baseline = "no-such-rev"
    assert report.run(args) == 2


def test_no_marks_without_history(tmp_path):
    (tmp_path / "results" / "nvidia-h200").mkdir(parents=True)
    (tmp_path / "results" / "nvidia-h200" / "gelu.json").write_text(json.dumps(rows(BASE)))
    assert "↓" not in report.results_tables(tmp_path / "results", configs_dir=tmp_path / "none")



def test_serving_results_show_their_batch_sweep(tmp_path):
    run = {"requests": 64, "output_tok_s": 1790.4, "tpot_ms": {"p50": 1.1078, "p99": 1.2}, "ttft_ms": {"p50": 42.0}}
    d = {"workload": {"requests": 64}, "model": "m", "dtype": "bfloat16", "command": "tritune serve-bench ...",
         "modes": {"triton-graphs": {"run": {"output_tok_s": 21028.0}, "batch_sweep": {"8": run, "2": run}}}}
    (tmp_path / "results" / "nvidia-h200").mkdir(parents=True)
    (tmp_path / "results" / "nvidia-h200" / "serve_x.json").write_text(json.dumps(d))
    text = report.results_tables(tmp_path / "results", configs_dir=tmp_path / "none")
    sweep = text[text.index("Batch sweep"):]
    assert "1790" in sweep and "1.11 / 1.20" in sweep and sweep.index("| 2 ") < sweep.index("| 8 ")

PROFILE = {"rows": [
    {"command": "generate ROMEO: --max-new-tokens 8", "gpu": "NVIDIA H200", "date": "2026-11-28",
     "summary": {}, "kernels": [], "trace": "trace-generate.json",
     "ncu": [{"kernel": "_gemm_kernel", "launches": 12, "duration_ns": 5200.0, "dram_bytes": 4.1e6, "dram_pct": 71.5,
              "sm_pct": 40.2, "tensor_pct": 22.0, "occupancy_pct": 18.4, "registers": 168.0,
              "smem_dynamic": 65536.0, "smem_static": 0.0},
             {"kernel": "_layer_norm_fwd", "launches": 12, "duration_ns": 2100.0, "dram_pct": 55.0, "sm_pct": 30.0,
              "occupancy_pct": 60.0, "registers": 32.0}]},
    {"command": "bench gelu", "gpu": "NVIDIA H200", "ncu": None, "summary": {}, "kernels": []},
]}


def test_plot_draws_the_counters_of_each_profiled_command(tmp_path):
    pytest.importorskip("matplotlib")
    from tritune.harness import plot

    gpu = tmp_path / "results" / "nvidia-h200"
    gpu.mkdir(parents=True)
    (gpu / "profile.json").write_text(json.dumps(PROFILE))
    (gpu / "gelu.json").write_text(json.dumps(rows(BASE)))
    paths = plot.render_counters(tmp_path / "results", tmp_path / "img")
    assert [p.name for p in paths] == ["ncu-nvidia-h200-generate_ROMEO_--max-new-tokens_8.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the profile's rows are no kernel table in the report, and the report embeds the chart
    assert "### nvidia-h200 / profile" not in report.results_tables(tmp_path / "results", configs_dir=tmp_path)
    docs = tmp_path / "docs" / "results.md"
    report.write_results_md(tmp_path / "results", docs)
    assert "![ncu-nvidia-h200-generate_ROMEO_--max-new-tokens_8](img/ncu-nvidia-h200-" in docs.read_text()
    assert (tmp_path / "docs" / "img" / paths[0].name).is_file()
