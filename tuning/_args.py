"""Argument parsing shared by the CLI modules (``harness/cli.py`` and ``tuning/cli.py``): no CLI module
imports another, so neither import order makes a cycle."""
from __future__ import annotations

import argparse
import re

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
          "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_dtype(s: str):
    import torch

    try:
        return getattr(torch, DTYPES[s.lower()])
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {s!r}; expected one of {sorted(DTYPES)}") from None


_UNITS = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}


def parse_duration(s: str) -> float:
    """``"30m"``, ``"1h30m"``, ``"90s"``, ``"45"`` (seconds) -> seconds; ValueError naming the text."""
    text = str(s).strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"{s!r} is not a duration (e.g. 30m, 1h30m, 90s, 45)")
    total = 0.0
    for num, unit in parts:
        if unit not in _UNITS:
            raise ValueError(f"{s!r}: unknown unit {unit!r} (s, m or h)")
        total += float(num) * _UNITS[unit]
    if total <= 0:
        raise ValueError(f"{s!r}: a duration must be positive")
    return total
