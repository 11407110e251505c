"""Reading a Hugging Face checkpoint's ``config.json``, for every family's config class."""
from __future__ import annotations

import json
from pathlib import Path


def config_json(path, checkpoint: str) -> dict:
    """The JSON object in ``path`` (a checkpoint's config.json). FileNotFoundError when there is no such file
    (the message says that ``checkpoint`` needs one), ValueError when it is not valid JSON or not an object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({checkpoint} needs config.json)")
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return d
