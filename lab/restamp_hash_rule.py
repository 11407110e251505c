"""Restamp the store after a change of the *rule* of ``tuning/store.py``'s source hash (not of any kernel's code):
an entry stamped with its kernel module's hash under the previous rule, computed on the code at HEAD, was tuned on
this very code, so it gets the hash of the same code under the current rule. Every other entry (stale under the
old rule) stays as it is, stale under the new one too. ``restamped`` records the old hash and why.

The previous rule hashed only the ``@triton.jit`` functions defined in the kernel's own module; the current one
adds the jitted functions it imports (gemm: gemv's ``_row_stats``) and those of the private modules of its
package that it holds (attention: ``_attention_gluon``, the Gluon kernel).

    python lab/restamp_hash_rule.py [--write]
"""
import argparse
import hashlib
import importlib
import inspect
import json
import subprocess
from pathlib import Path

from tritune import kernels as K
from tritune.tuning import store

REPO = Path(__file__).resolve().parents[1]


def previous_rule(modname: str) -> str | None:
    mod = importlib.import_module(modname)
    srcs = [f"{name}\n{inspect.getsource(obj.fn)}" for name, obj in sorted(vars(mod).items())
            if store._jitted(obj) and getattr(obj.fn, "__module__", None) == mod.__name__]
    return hashlib.sha256("\n".join(srcs).encode()).hexdigest()[:12] if srcs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    K.all_specs()   # every kernel registered
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    for path in sorted(store.package_root().glob("*/*.json")):
        data = json.loads(path.read_text())
        if json.dumps(data, indent=1) + "\n" != path.read_text():
            print(f"{path}: not in the store writer's format, left alone")
            continue
        kname = data.get("kernel")
        spec = store._spec(kname)
        modname = getattr(getattr(spec, "run", None), "__module__", None)
        if modname is None:
            print(f"{path.relative_to(REPO)}: no registered launcher for {kname!r}, left alone")
            continue
        importlib.import_module(modname)
        old, new = previous_rule(modname), store.source_hash(kname)
        if old == new:
            continue
        n = 0
        for e in data["entries"]:
            if e.get("source") == old:
                e["source"] = new
                e["restamped"] = {"from": old, "commit": head,
                                  "why": "the same code, hashed by the current rule (lab/restamp_hash_rule.py)"}
                n += 1
        left = sum(e.get("source") != new for e in data["entries"])
        print(f"{path.relative_to(REPO)}: {old} -> {new}: {n} entries restamped, {left} left stale")
        if a.write and n:
            path.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
