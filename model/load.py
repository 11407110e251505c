"""Where a model comes from: the packaged checkpoint, a directory given by the user, its sampling defaults."""
from __future__ import annotations

import sys
from pathlib import Path


# Short names of the checkpoints the package ships -> their folder under model/ (``--model llama``).
PACKAGED = {"default": "default", "llama": "default_llama"}


def default_model_dir(name: str = "default") -> Path | None:
    """A packaged checkpoint (model/default/, or another of :data:`PACKAGED`), when one has been trained into it."""
    import tritune.model

    d = Path(list(tritune.model.__path__)[0]) / PACKAGED[name]  # __file__ is None for a stale namespace install
    return d if (d / "config.json").is_file() else None


def packaged_or(model):
    """``model`` as given, or the packaged checkpoint it names (a :data:`PACKAGED` key that is not a path)."""
    if isinstance(model, str) and model in PACKAGED and not Path(model).exists():
        return default_model_dir(model) or model
    return model


def model_or_default(model):
    """MODEL as the user gave it, else the packaged checkpoint; None, after one line on stderr, when neither
    exists (the caller exits 2)."""
    path = packaged_or(model) or default_model_dir()
    if path is None:
        print("error: no MODEL given and no packaged checkpoint (model/default/config.json is missing)",
              file=sys.stderr)
    return path


def sampling_defaults(model_dir) -> dict:
    """Sampling settings from the checkpoint's ``generation_config.json`` (Hugging Face's file), if any:
    ``{"temperature": ..., "top_k": ..., "top_p": ...}``; greedy when absent or ``do_sample`` is false."""
    import json

    out = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return out
    try:
        g = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        print(f"note: ignoring {f}: {e}", file=sys.stderr)
        return out
    if not isinstance(g, dict) or not g.get("do_sample"):
        return out
    out["temperature"] = float(g.get("temperature", 1.0))
    out["top_k"] = int(g.get("top_k", 0) or 0)
    out["top_p"] = float(g.get("top_p", 1.0))
    return out


def model_type(directory) -> str | None:
    """config.json's ``model_type`` (None when the file is missing or malformed: the loader says why)."""
    import json

    try:
        d = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return d.get("model_type") if isinstance(d, dict) else None


def load_model(model, *, backend: str = "triton", dtype=None, device=None):
    """A checkpoint directory or hub id -> the model of its family (:mod:`tritune.model.families`, by
    config.json's ``model_type``), quantized checkpoints (``tritune quantize``'s) included. ``dtype``
    default: :func:`default_dtype` of where it runs."""
    from tritune.model import families
    from tritune.model.gpt2 import weights as W

    directory = W.resolve(packaged_or(model))
    mt = model_type(directory)
    if mt is None and not (Path(directory) / "config.json").is_file():
        raise FileNotFoundError(f"{directory}: no config.json (expected a checkpoint directory)")
    load = families.loader(mt)
    return load(directory, backend=backend, dtype=default_dtype() if dtype is None else dtype, device=device)


def default_dtype(device=None):
    """The activation dtype a command runs in unless told: bf16 on a CUDA device, fp32 on the CPU (whose
    bf16 matmuls are slow and whose interpreter runs fp32 kernels exactly). ``device`` None: a GPU if any."""
    import torch

    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return torch.bfloat16 if cuda else torch.float32


def set_cpu_threads(unless_changed_from: int | None = None) -> None:
    """Torch's CPU threads for an engine on the CPU: at most half the cores (a no-op with a CUDA GPU or
    ``OMP_NUM_THREADS`` set). A full-width OpenMP team waits at every op's barrier for a worker another
    process (the server's API process, a tokenizer, a terminal) has descheduled; on a busy 2-core machine
    that made steps 30x slower. ``unless_changed_from``: a thread count seen earlier; when the count is no
    longer that, the program set its own, which is left alone (the library's engine passes it)."""
    import os

    import torch

    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        return
    n = torch.get_num_threads()
    if unless_changed_from is not None and n != unless_changed_from:
        return
    torch.set_num_threads(max(1, min(n, (os.cpu_count() or 2) // 2)))
