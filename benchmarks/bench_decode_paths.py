"""Batch-1 decode tok/s through ``tritune generate`` and through the Engine, and serve-bench output tok/s:
the numbers that must not move when the request path changes. Runs against whatever tritune is installed
(no API newer than the engine's public one), so the same command measures before and after a change.

    python benchmarks/bench_decode_paths.py [--results DIR] [--model DIR] [--new-tokens 200] [--reps 5] [--serve-n 512]

Appends one keyed row per path (benchmarks/rows.py: commit, date, GPU, versions) to
results/<gpu-slug>/decode_paths.json: its runs and median (serve-bench: its output tok/s per mode, its own
JSON kept in a temporary folder). ``tritune generate`` runs as users run it (a subprocess per rep, greedy and
with the checkpoint's sampling); its decode tok/s is the one its timing line prints.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

LINE = re.compile(r"decode (\d+) tokens in ([\d.]+) ms \(([\d.na]+) tok/s\)")


def sh(*cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def cli_generate(model, prompt, new, reps, extra):
    runs = []
    for _ in range(reps):
        cmd = ["tritune", "generate", prompt, "--max-new-tokens", str(new), *extra]
        if model:
            cmd += ["--model", model]
        p = sh(*cmd)
        m = LINE.search(p.stderr)
        if p.returncode or not m:
            return {"error": (p.stderr or p.stdout)[-2000:], "command": " ".join(cmd)}
        runs.append({"tokens": int(m.group(1)) + 1, "decode_tok_s": float(m.group(3))})
    return {"command": " ".join(cmd), "runs": runs,
            "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}


def engine_batch1(model, new, reps, dtype):
    import torch

    from tritune.model.load import default_model_dir
    from tritune.model.engine.engine import Engine
    from tritune.model.gpt2.model import GPT2
    from tritune.model.engine.scheduler import SamplingParams

    m = GPT2.from_pretrained(model or default_model_dir(), backend="triton" if torch.cuda.is_available() else "torch",
                             dtype=getattr(torch, dtype))
    new = min(new, m.config.n_positions - 16)
    eng = Engine(m, num_blocks=-(-m.config.n_positions // 16), max_num_seqs=1, cuda_graphs=True)
    prompt = [(7 * i) % (m.config.vocab_size - 1) for i in range(16)]
    runs = []
    for rep in range(reps + 1):                 # the first run warms up (compiles, allocator)
        req = eng.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        eng.run()
        dt = req.finish_time - req.first_token_time
        if rep:
            runs.append({"tokens": new, "decode_tok_s": (new - 1) / dt})
    return {"notes": eng.notes, "runs": runs, "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="results root (default: results)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the packaged one)")
    ap.add_argument("--prompt", default="ROMEO:")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--serve-n", type=int, default=512, help="serve-bench requests (0: skip serve-bench)")
    a = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="decode_paths_"))
    res = {}
    dirty = bool(sh("git", "status", "--porcelain", "--untracked-files=no").stdout.strip())
    t0 = time.time()
    res["generate_greedy"] = cli_generate(a.model, a.prompt, a.new_tokens, a.reps, ["--temperature", "0"])
    res["generate_sampled"] = cli_generate(a.model, a.prompt, a.new_tokens, a.reps, ["--seed", "0"])
    res["engine_batch1"] = engine_batch1(a.model, a.new_tokens, a.reps, a.dtype)
    if a.serve_n:
        p = sh("tritune", "serve-bench", "-n", str(a.serve_n), "--out", str(out / "serve.json"))
        res["serve_bench"] = {"returncode": p.returncode, "tail": p.stdout[-3000:]}
        if (out / "serve.json").is_file():
            sb = json.loads((out / "serve.json").read_text())
            res["serve_bench"]["output_tok_s"] = {k: v["run"]["output_tok_s"] for k, v in sb["modes"].items()
                                                  if "run" in v}
    path = write_rows("decode_paths", [{"path": k, **v} for k, v in res.items()], a.results,
                      dirty=dirty, seconds=round(time.time() - t0, 1), command=" ".join(sys.argv))
    print(json.dumps({k: (v.get("median_decode_tok_s", v.get("output_tok_s", v.get("error")))
                          if isinstance(v, dict) else v) for k, v in res.items()}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
