"""Where a model comes from: the packaged checkpoint, a directory given by the user, its sampling defaults."""
from __future__ import annotations

import sys
from pathlib import Path


def default_model_dir() -> Path | None:
    """The packaged checkpoint (model/default/), when one has been trained into it."""
    import tritune.model

    d = Path(list(tritune.model.__path__)[0]) / "default"  # __file__ is None for a stale namespace install
    return d if (d / "config.json").is_file() else None


def model_or_default(model):
    """MODEL as the user gave it, else the packaged checkpoint; None, after one line on stderr, when neither
    exists (the caller exits 2)."""
    path = model or default_model_dir()
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
