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
    return interpreted()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


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


def cache_dir() -> Path:
    d = Path(os.environ.get("TRITUNE_CACHE", Path.home() / ".cache" / "tritune"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.lru_cache(maxsize=None)
def ceilings() -> dict:
    """Measured copy bandwidth (bytes/s, read+write) and bf16/fp16/fp32 matmul peak (FLOP/s).

    Measured once per GPU type and cached in ``~/.cache/tritune/ceilings-<slug>.json``: the roofline is
    against what this card does, not its datasheet. Under the interpreter there are no ceilings.
    """
    if interpreted():
        return {}
    path = cache_dir() / f"ceilings-{gpu_slug()}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    c = measure_ceilings()
    path.write_text(json.dumps(c, indent=1))
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
