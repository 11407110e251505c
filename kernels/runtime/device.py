"""What machine we run on: GPU or interpreter, the GPU-type slug, and measured ceilings."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path


def setup_interpreter() -> bool:
    """Turn on Triton's interpreter when there is no CUDA GPU (before triton is imported).

    An explicit ``TRITON_INTERPRET`` in the environment wins either way.
    """
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    if interpreted():
        # The interpreter computes each op with numpy, which warns where IEEE arithmetic overflows to inf; the
        # kernels count on that inf (GELU's exp(-2z) for a large negative z gives the limit, 0), as a GPU does.
        import warnings

        warnings.filterwarnings("ignore", r"overflow encountered in (exp|exp2)", RuntimeWarning,
                                r"triton\.runtime\.interpreter")
    return interpreted()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def hopper() -> bool:
    """A GPU of compute capability 9.x runs the kernels here (Gluon's sm90 kernels); never the interpreter."""
    import torch

    return not interpreted() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def device() -> str:
    """The device kernels run on: 'cuda' on a GPU, 'cpu' under the interpreter."""
    return "cpu" if interpreted() else "cuda"


def slugify(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@functools.lru_cache(maxsize=None)
def gpu_name() -> str:
    if interpreted():
        return "triton-interpreter"
    import torch

    return torch.cuda.get_device_name()


@functools.lru_cache(maxsize=None)
def gpu_slug() -> str:
    """e.g. 'nvidia-h100-80gb-hbm3'; 'triton-interpreter' on the CPU. ``TRITUNE_GPU_SLUG`` overrides."""
    return os.environ.get("TRITUNE_GPU_SLUG") or slugify(gpu_name())


# Where each thing tritune writes under the user's cache folder can be sent instead: named in the one-line
# error when that folder cannot be written (a read-only or missing HOME).
ELSEWHERE = ("set TRITUNE_CACHE to a writable folder, or send the user config store elsewhere with "
             "TRITUNE_CONFIG_DIR or --configs-dir and the studies journal with --storage or TRITUNE_STUDIES")


class CacheError(OSError):
    """A folder tritune writes to cannot be made or written: the message says what was being written, where,
    why, and how to send it elsewhere (one line)."""


def cache_path() -> Path:
    """tritune's user cache folder (``$TRITUNE_CACHE``, else ``~/.cache/tritune``), not created: reading
    needs no writable HOME."""
    return Path(os.environ.get("TRITUNE_CACHE") or Path.home() / ".cache" / "tritune").expanduser()


def make_dir(d: Path, what: str) -> Path:
    """Create ``d`` (and its parents) for writing ``what`` (e.g. "the studies journal"); CacheError if it
    cannot be."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cannot write {what}: cannot create {d}: {e.strerror or e}; {ELSEWHERE}") from None
    return d


def cache_dir(what: str = "tritune's cache") -> Path:
    """tritune's user cache folder, created for writing ``what`` (CacheError naming it when it cannot be)."""
    return make_dir(cache_path(), what)


@functools.lru_cache(maxsize=None)
def ceilings() -> dict:
    """Measured copy bandwidth (bytes/s, read+write) and bf16/fp16/fp32 matmul peak (FLOP/s).

    Measured once per GPU type and cached in ``~/.cache/tritune/ceilings-<slug>.json``: the roofline is
    against what this card does, not its datasheet. Under the interpreter there are no ceilings.
    """
    if interpreted():
        return {}
    path = cache_path() / f"ceilings-{gpu_slug()}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    c = measure_ceilings()
    try:
        make_dir(path.parent, "the measured ceilings").joinpath(path.name).write_text(json.dumps(c, indent=1))
    except OSError:
        pass   # not cached (an unwritable cache folder): measured again by the next process
    return c


def measure_ceilings() -> dict:
    import torch
    import triton.testing

    n = 1 << 30  # 1 GiB each way: far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    out = {"copy_bytes_per_s": 2 * n / (ms * 1e-3)}
    del src, dst
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        s = 8192
        a = torch.randn(s, s, device="cuda", dtype=dt)
        b = torch.randn(s, s, device="cuda", dtype=dt)
        ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
        out[f"matmul_flops_per_s_{str(dt).split('.')[-1]}"] = 2 * s**3 / (ms * 1e-3)
    out["gpu"] = gpu_name()
    return out
