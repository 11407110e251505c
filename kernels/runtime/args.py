"""Argument parsing shared by the command-line modules (``harness/cli/`` and the model's commands, which sit
below it): no CLI module imports another for it, so no import order makes a cycle."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

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


def int_at_least(lo: int):
    """An argparse type: an integer >= ``lo`` (a count, a size), refused at parse time by value."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    parse.__name__ = f"int>={lo}"
    return parse


def block_size(text: str) -> int:
    """An argparse type: a KV-cache block size, a power of two in [1, 256] (the engine's rule, at parse time)."""
    from tritune.kernels.runtime.checks import BLOCK_SIZES, is_block_size

    v = int_at_least(1)(text)
    if not is_block_size(v):
        raise argparse.ArgumentTypeError(f"expected {BLOCK_SIZES}, got {v}")
    return v


def number_in(text: str, ok, want: str) -> float:
    """``text`` as a float for which ``ok(value)`` holds, else an ArgumentTypeError saying ``want``."""
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if v != v or not ok(v):   # NaN (or no number) is never in range
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
    return v


def positive_number(text: str) -> float:
    """An argparse type: a number > 0 (``inf`` allowed, as a rate's "all at once"; NaN is not)."""
    return number_in(text, lambda v: v > 0, "a positive number")


def nonnegative_number(text: str) -> float:
    """An argparse type: a finite number >= 0 (a margin, a threshold)."""
    return number_in(text, lambda v: 0 <= v < float("inf"), "a finite number >= 0")


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    return number_in(text, lambda v: 0 < v <= 1, "a fraction in (0, 1]")


class UsageError(Exception):
    """A user's mistake: the CLI prints the message on one line and exits 2."""


def writable_dir(text: str) -> Path:
    """An argparse type: a folder that exists or can be made (a file in the way, or no permission, is an
    error at parse time rather than a traceback after the work)."""
    p = Path(text).expanduser()
    if p.exists():
        if not p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
        if not os.access(p, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r}: no permission to write there")
        return p
    parent = next((a for a in p.absolute().parents if a.exists()), None)
    if parent is None or not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: no permission to create it under {parent}")
    return p
