"""The one translation of attention's stored configs from the single ``WARP_SPEC`` key (0-7, which packed the
implementation, the key loop's schedule and the persistent form into one number) to the explicit keys
``IMPL``, ``SCHEDULE`` and ``PERSISTENT``. The store files were translated once with :func:`migrate_file`; the
space has no ``WARP_SPEC``. Kept for configs written before (a user's store layer, a saved study's trials):
:func:`translate` leaves a config without ``WARP_SPEC`` as it is, so running it again changes nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

# WARP_SPEC -> (IMPL, SCHEDULE, PERSISTENT): 0-2 the Triton kernel's loop schedules, 3-5 the Gluon kernel's
# GEMM schedules 0-2, 6-7 its persistent form with schedules 1-2
WARP_SPEC = {0: ("triton", "pipelined", 0), 1: ("triton", "warp_specialized", 0), 2: ("triton", "ahead", 0),
             3: ("gluon", "ahead", 0), 4: ("gluon", "intra_wg", 0), 5: ("gluon", "pingpong", 0),
             6: ("gluon", "intra_wg", 1), 7: ("gluon", "pingpong", 1)}


def translate(config: dict) -> dict:
    """``config`` with ``WARP_SPEC`` replaced, in its place, by IMPL, SCHEDULE and PERSISTENT; a config without
    it is returned unchanged (a copy). ValueError for a WARP_SPEC that never existed."""
    if "WARP_SPEC" not in config:
        return dict(config)
    ws = config["WARP_SPEC"]
    if isinstance(ws, bool) or ws not in WARP_SPEC:
        raise ValueError(f"config: WARP_SPEC={ws!r} is none of {sorted(WARP_SPEC)}")
    impl, schedule, persistent = WARP_SPEC[ws]
    out = {}
    for k, v in config.items():
        if k == "WARP_SPEC":
            out.update(IMPL=impl, SCHEDULE=schedule, PERSISTENT=persistent)
        else:
            out[k] = v
    return out


def migrate_entries(entries: list[dict]) -> int:
    """Translate the ``config`` and ``default_config`` of store entries in place; returns how many changed."""
    n = 0
    for e in entries:
        changed = False
        for key in ("config", "default_config"):
            if isinstance(e.get(key), dict) and "WARP_SPEC" in e[key]:
                e[key] = translate(e[key])
                changed = True
        n += changed
    return n


def migrate_file(path, source: str | None = None) -> int:
    """Translate one store file (tuning/configs/<gpu>/attention*.json) in place; ``source``: the hash to
    record in every entry (the entries' code is unchanged, proven per entry by compiling both). Returns the
    number of entries changed; a file already translated is left byte for byte as it was."""
    path = Path(path)
    data = json.loads(path.read_text())
    n = migrate_entries(data.get("entries", []))
    moved = False
    if source is not None:
        for e in data.get("entries", []):
            if e.get("source") not in (None, source):
                e["source"] = source
                moved = True
    if n or moved:
        path.write_text(json.dumps(data, indent=1) + "\n")
    return n
