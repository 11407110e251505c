"""``tritune generate``: stream a GPT-2 completion to the terminal, then a line of timings.

It runs through the serving engine at batch 1 (:func:`tritune.model.engine.generate.stream`), so the context
limit, stop rules and sampling are the engine's; a request that does not fit is one line naming the
flags that fix it (``--max-new-tokens``, ``--truncate``), exit status 2."""
from __future__ import annotations

import sys

from tritune.model.load import default_model_dir, sampling_defaults


def add_parser(subparsers, name: str) -> None:
    if name != "generate":
        return
    from tritune.kernels.runtime.args import parse_dtype

    s = subparsers.add_parser("generate", help="generate text with GPT-2 on tritune kernels (streams)")
    s.add_argument("prompt", help="the prompt text")
    s.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face hub id, dense or quantized (`tritune quantize`'s "
                        "GPTQ/AWQ output; default: the packaged checkpoint; `llama`: the packaged Llama-style one)")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the checkpoint's generation_config.json, else greedy)")
    s.add_argument("--top-k", type=int, default=None, help="0 disables top-k (default: as --temperature)")
    s.add_argument("--top-p", type=float, default=None, help="1 disables top-p (default: as --temperature)")
    s.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    s.add_argument("--backend", choices=("triton", "torch"), default=None,
                   help="default: triton with a CUDA GPU, torch without")
    s.add_argument("--dtype", type=parse_dtype, default=None, help="fp32, fp16 or bf16 (default: bf16 on a "
                   "GPU, fp32 on the CPU)")
    s.add_argument("--truncate", action="store_true",
                   help="drop the prompt's first tokens when it does not fit the context")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels (the tokens a server started with --deterministic gives this "
                        "request, whatever else it serves)")
    s.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: prompt lookup (ngram) or a draft model (draft: --draft, default the "
                        "checkpoint's own draft/, which the packaged model ships); same tokens when greedy, the same "
                        "distribution when sampled")
    s.add_argument("--draft", default=None, help="--speculative draft: the draft checkpoint (sharing the tokenizer)")
    s.add_argument("--spec-k", type=int, default=None,
                   help="--speculative: draft tokens per step (default 4 for ngram, 2 for draft)")
    s.add_argument("--kv-cache-dtype", choices=("fp8",), default=None,
                   help="fp8: the paged KV cache in e4m3 with per-token scales (default: the model's dtype)")
    s.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism: split the model over this many ranks (processes started here; gloo on "
                        "the CPU, NCCL on GPUs)")
    s.set_defaults(func=run)


def _model_path(args):
    """The checkpoint to load, or None after one line on stderr; the prompt is checked first, before any load."""
    from tritune.model.tokenizer import check_text

    try:
        check_text(args.prompt)
    except ValueError as e:
        print(f"tritune generate: {e}", file=sys.stderr)
        return None
    if args.model is not None:
        return args.model
    d = default_model_dir()
    if d is None:
        print("tritune generate: no packaged default checkpoint (model/default/config.json is missing); "
              "pass --model DIR or a hub id such as --model gpt2", file=sys.stderr)
    return d


def run(args) -> int:
    import torch

    from tritune.model.engine.generate import stream
    from tritune.model.engine.scheduler import ContextLimitError
    from tritune.model.load import default_dtype, load_model, set_cpu_threads
    from tritune.model.tokenizer import Tokenizer

    model_path = _model_path(args)
    if model_path is None:
        return 2
    gpu = torch.cuda.is_available()
    backend = args.backend
    if backend is None:
        backend = "triton" if gpu else "torch"
        if not gpu:
            print("note: no CUDA GPU; using the torch backend (pass --backend triton to run the kernels "
                  "through the Triton interpreter, slowly)", file=sys.stderr)
    dtype = args.dtype or default_dtype()
    set_cpu_threads()
    model = None
    try:
        if args.tp > 1:
            from tritune.model.parallel.group import use_local_gpu

            use_local_gpu()     # under torchrun: this rank's GPU before the model lands on "cuda"
        model = load_model(model_path, backend=backend, dtype=dtype)
        if args.deterministic:
            from tritune.model.engine.invariant import invariant_model

            model = invariant_model(model)
        model = _tensor_parallel(model, args)
        if model is None:       # a torchrun rank other than 0: it followed rank 0's engine to the end
            return 0
        tok = Tokenizer.from_dir(model.directory)
        spec = None
        if args.speculative:
            from tritune.model.engine.spec_decode import make_proposer

            spec = make_proposer(args.speculative, model, k=args.spec_k, draft=args.draft)
        elif args.draft is not None:
            raise ValueError("draft: --draft needs --speculative draft")
        sd = sampling_defaults(model.directory)
        temperature = sd["temperature"] if args.temperature is None else args.temperature
        top_k = sd["top_k"] if args.top_k is None else args.top_k
        top_p = sd["top_p"] if args.top_p is None else args.top_p
        g = stream(model, args.prompt, tokenizer=tok, max_new_tokens=args.max_new_tokens,
                   temperature=temperature, top_k=top_k, top_p=top_p, seed=args.seed,
                   stop=args.stop, truncate=args.truncate, speculative=spec, kv_cache_dtype=args.kv_cache_dtype)
    except ContextLimitError as e:
        _close_tp(model)
        print(f"tritune generate: {e.describe(lambda n: f'--max-new-tokens {n}', '--truncate')}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, ValueError, TypeError) as e:
        _close_tp(model)
        print(f"tritune generate: {_flags(str(e))}", file=sys.stderr)
        return 2
    if g.result.truncated:
        print(f"note: prompt truncated: dropped its first {g.result.truncated} tokens", file=sys.stderr)
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    for ev in g:
        if ev.text:
            out.write(ev.text)
            out.flush()
    r = g.result
    out.write("\n")
    spec_note = ""
    if spec is not None:
        st = g.engine.stats
        spec_note = (f"; {spec.name}: {st['spec_accepted']}/{st['spec_proposed']} drafts accepted"
                     if st.get("spec_proposed") else f"; {spec.name}: no drafts proposed")
    g.engine.close()        # (the other ranks of --tp)
    tp_note = f", tp {args.tp}" if args.tp > 1 else ""
    print(f"[{backend}, {str(dtype).replace('torch.', '')}, {model.device}{tp_note}] {r.timings}; "
          f"stopped: {r.finish_reason}{spec_note}", file=sys.stderr)
    return 0


def _tensor_parallel(model, args):
    """--tp N: rank 0's shard of the model, the other ranks started (tritune.model.parallel); under torchrun
    (N ranks started by it) every rank joins, and a rank other than 0 follows rank 0 and returns None."""
    if args.tp == 1:
        return model
    from tritune.model.parallel.group import torchrun_rank
    from tritune.model.parallel.serving import engine_model, follow_torchrun

    env = torchrun_rank()
    if env is not None and env[1] == args.tp and env[0] != 0:
        follow_torchrun(model)
        return None

    return engine_model(model, args.tp, batch_invariant=args.deterministic, speculative=args.speculative,
                        kv_cache_dtype=args.kv_cache_dtype)


def _close_tp(model) -> None:
    """Stop the ranks --tp started (a command that fails after starting them)."""
    if getattr(model, "tp", None) is not None:
        from tritune.model.parallel.serving import engine_close

        engine_close(model, None)


def _flags(msg: str) -> str:
    """A library message in the command line's terms: argument names become the flags that set them."""
    if msg.startswith("k: "):       # the proposer's draft length
        msg = "--spec-k: " + msg[3:]
    msg = msg.replace("tensor_parallel:", "--tp:", 1)
    for name in ("max_new_tokens", "temperature", "top_k", "top_p", "draft"):
        msg = msg.replace(f"{name}:", f"--{name.replace('_', '-')}:", 1)
    return msg
