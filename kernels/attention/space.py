"""Attention's config space (shared by both specs: their problems both answer B, Hq, Hkv, Tq, Tk, D, causal),
its constraint, the default configs and the Gluon kernel's seeds.

Three keys say which code runs: ``IMPL`` ("triton": :mod:`.triton_fwd`; "gluon": the FA3-structured kernel
of :mod:`.gluon`, sm90 only), ``SCHEDULE`` (the order of the key loop's GEMMs and softmax, by name: see
:data:`SCHEDULES`) and ``PERSISTENT`` (the Gluon kernel's persistent form, one CTA per SM over the work
items). The constraint refuses what an implementation does not have (a Gluon schedule on the Triton kernel,
the persistent form of the Triton kernel, BLOCK_M=192 outside the Gluon kernel).
"""
from __future__ import annotations

import torch
import triton

from tritune import kernels as K
from tritune.kernels.attention import gluon as G
from tritune.kernels.attention.problem import PackedProblem, VarlenProblem

# Each implementation's schedules. "ahead": the next key block's q·kᵀ issued before this block's softmax
# (both kernels); "pipelined": Triton's software pipeliner alone; "warp_specialized": Triton splits the loop
# into TMA producer and MMA consumer warps; "intra_wg": FA3's intra-warpgroup overlap (q·kᵀ of block j+1 and
# P_j·V_j issued together, the softmax of j+1 under P_j·V_j); "pingpong": that, with the consumer warpgroups
# taking turns to issue their GEMMs (FA3's ping-pong).
SCHEDULES = {"triton": ("pipelined", "warp_specialized", "ahead"), "gluon": ("ahead", "intra_wg", "pingpong")}
PERSISTENT_SCHEDULES = ("intra_wg", "pingpong")   # the persistent Gluon kernel's

SPACE = K.Space(
    params={
        # 192: the Gluon kernel's CTA of three consumer warpgroups (FA3's tile at D <= 64), that kernel's only
        "BLOCK_M": [16, 32, 64, 128, 192],
        "BLOCK_N": [16, 32, 64, 128],
        "num_warps": [2, 4, 8],
        "num_stages": [1, 2, 3, 4, 5],
        "HEADS_INNER": [0, 1],
        # Q/K/V/O through TMA tensor descriptors (sm90+; 1: made by each program on the device, 2: made once on
        # the host over the (B, H, T, D) tensors, no per-program cost)
        "TMA": [0, 1, 2],
        "IMPL": ["triton", "gluon"],
        "SCHEDULE": ["pipelined", "warp_specialized", "ahead", "intra_wg", "pingpong"],
        "PERSISTENT": [0, 1],
        "LAZY_RESCALE": [0, 1],
    },
)

_CAP = []


def capability() -> tuple:
    """The GPU's compute capability; the interpreter counts as a Hopper (it runs the TMA path)."""
    from tritune.kernels.runtime import device as dev

    if not _CAP:
        _CAP.append((9, 0) if dev.interpreted() else tuple(torch.cuda.get_device_capability()))
    return _CAP[0]


def _smem_budget() -> int:
    from tritune.kernels.runtime import device as dev

    if dev.interpreted():
        return 227 * 1024  # the interpreter has no limit; prune as for an H100
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


_SMEM = []


def smem_limit() -> int:
    """This device's shared memory per block (measured once)."""
    if not _SMEM:
        _SMEM.append(_smem_budget())
    return _SMEM[0]


def smem_bytes(c, D: int, dtype) -> int:
    """Shared memory the Triton kernel needs, by the pipeliner's rule: Q once, K and V tiles for each load in
    flight (num_stages − 1, at least 1), and a P tile for the layout change before the second dot; the TMA
    path also stages O in shared memory for its store. Scores one block ahead (SCHEDULE="ahead") keep a K and
    a V tile for every stage (measured on the H200: 128 x 128 tiles, D=128, 3 stages need 262,144 B, 8 tiles)."""
    e = torch.finfo(dtype).bits // 8
    bd = triton.next_power_of_2(D)
    buffers = c["num_stages"] if c.get("SCHEDULE") == "ahead" else max(1, c["num_stages"] - 1)
    o_stage = c["BLOCK_M"] * bd if c.get("TMA") else 0
    return e * (c["BLOCK_M"] * bd + 2 * buffers * c["BLOCK_N"] * bd + c["BLOCK_M"] * c["BLOCK_N"] + o_stage)


def _gluon_call_constraint(c, p, dtype) -> str | None:
    """What of the call (not the tiles) the Gluon kernel refuses."""
    from tritune.kernels.runtime import device as dev

    # the interpreter counts as a Hopper here too (stored sm90 entries stay valid points on a CPU); it cannot
    # run Gluon, so its launches take the Triton kernel (launch.gluon_plan)
    if not dev.interpreted() and (not G.AVAILABLE or capability()[0] != 9):
        return "IMPL=gluon (the Gluon FA3 kernel) runs on sm90 GPUs only"
    if dtype not in (torch.float16, torch.bfloat16):
        return "IMPL=gluon (the Gluon FA3 kernel): fp16 and bf16 only"
    # a packed sequence's rows that see no key are the kernel's own case (they output 0); a dense call's are not
    if p.causal and p.Tq > p.Tk and not isinstance(p, (VarlenProblem, PackedProblem)):
        return "IMPL=gluon (the Gluon FA3 kernel): dense causal needs Tq <= Tk"
    if p.B * p.Hq > 65535:   # its grid is (query tiles, batch x heads): CUDA caps the second dimension
        return "IMPL=gluon (the Gluon FA3 kernel): at most 65,535 batch x heads"
    if c["SCHEDULE"] not in SCHEDULES["gluon"]:
        return f"IMPL=gluon: SCHEDULE one of {SCHEDULES['gluon']}"
    if c["PERSISTENT"] and c["SCHEDULE"] not in PERSISTENT_SCHEDULES:
        return f"PERSISTENT=1 (the persistent Gluon kernel): SCHEDULE one of {PERSISTENT_SCHEDULES}"
    if c["PERSISTENT"] and isinstance(p, (VarlenProblem, PackedProblem)):
        return "PERSISTENT=1 (the persistent Gluon kernel): dense calls only"
    if (c["num_warps"], c["HEADS_INNER"], c["TMA"], c["LAZY_RESCALE"]) != (4, 0, 2, 0):
        return ("IMPL=gluon (the Gluon FA3 kernel) takes num_warps=4, HEADS_INNER=0, TMA=2, "
                "LAZY_RESCALE=0 (the keys it does not read, fixed)")
    return None


def _gluon_constraint(c, p, dtype) -> str | None:
    """The Gluon kernel's points: one canonical value of every key it does not read, its own tiles."""
    why = _gluon_call_constraint(c, p, dtype)
    if why is not None:
        return why
    bd = triton.next_power_of_2(p.D)
    if c["BLOCK_M"] not in (G.ROWS, G.ROWS3):
        return "IMPL=gluon (the Gluon FA3 kernel): BLOCK_M 128 (two consumer warpgroups) or 192 (three)"
    if c["BLOCK_N"] not in ((64, 128) if bd <= 128 else (64,)):
        # two score tiles and the output per consumer thread: 240 registers hold 128-key tiles up to D=128
        return "IMPL=gluon (the Gluon FA3 kernel): BLOCK_N 64 or 128 up to D=128, 64 past it"
    persistent_pp = c["PERSISTENT"] and c["SCHEDULE"] == "pingpong"
    if c["BLOCK_M"] == G.ROWS3 and (bd > 128 or (bd > 64 and (c["BLOCK_N"] > 64 or persistent_pp))
                                    or (c["BLOCK_N"] > 64 and c["SCHEDULE"] == "ahead")):
        # three consumer warpgroups leave each 160 registers; these points spill (sm90 SASS, triton 3.6)
        return ("IMPL=gluon with BLOCK_M=192 (three consumer warpgroups, 160 registers each): up to D=64, "
                "BLOCK_N=64 up to D=128 but not the persistent ping-pong there, and not SCHEDULE='ahead' "
                "with BLOCK_N=128")
    if c["num_stages"] < 2:   # deeper rings, up to the space's 5, where they fit in shared memory
        return "IMPL=gluon (the Gluon FA3 kernel): 2 stages or more"
    need = G.smem_bytes(p.D, c["BLOCK_N"], c["num_stages"], persistent=bool(c["PERSISTENT"]), rows=c["BLOCK_M"])
    if need > smem_limit():
        return f"needs {need} B of shared memory (budget {smem_limit()})"
    return None


def _triton_keys_constraint(c, p) -> str | None:
    """The Triton kernel's refusals that follow from its keys alone (and the problem's extents)."""
    bm, bn, w, sch = c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["SCHEDULE"]
    if sch not in SCHEDULES["triton"]:
        return f"IMPL=triton: SCHEDULE one of {SCHEDULES['triton']}"
    if c["PERSISTENT"]:
        return "PERSISTENT=1 is the Gluon kernel's (IMPL=gluon)"
    if bm != triton.next_power_of_2(bm):
        return "BLOCK_M=192 is the Gluon kernel's (IMPL=gluon: three consumer warpgroups)"
    if bm > max(16, triton.next_power_of_2(p.Tq)):
        return "BLOCK_M larger than the queries"
    if bn > max(16, triton.next_power_of_2(p.Tk)):
        return "BLOCK_N larger than the keys"
    if bm < 8 * w:
        return "idle warps (fewer than 8 rows a warp)"
    if sch == "warp_specialized" and not c["TMA"]:
        return "SCHEDULE='warp_specialized' needs TMA (the producer warps issue TMA loads)"
    if sch == "warp_specialized" and c["TMA"] == 2:
        # triton's own Hopper attention (tutorial 06) makes its descriptors on the device when it
        # warp-specializes; host-built ones are not known to go through that pass
        return "SCHEDULE='warp_specialized' takes the per-program descriptors (TMA=1), not host-built ones"
    if c["TMA"] == 2 and isinstance(p, VarlenProblem):
        return "TMA=2: a packed batch's sequences are no descriptor dimension (varlen runs TMA=1)"
    if sch == "warp_specialized" and c["num_warps"] < 8 and not c["LAZY_RESCALE"]:
        # triton 3.6 on sm90 aborts in its warp-specialization pass (TaskIdPropagation.cpp:162, "isa<scf::IfOp>
        # || isa<scf::ForOp>") for this combination (H100, D=64, 4 warps, 3 stages), in the GPU test suite
        return ("SCHEDULE='warp_specialized' with fewer than 8 warps needs LAZY_RESCALE (triton 3.6's "
                "warp-specialization pass aborts)")
    return None


def _constraint(c, p, dtype) -> str | None:
    if c["IMPL"] == "gluon":
        return _gluon_constraint(c, p, dtype)
    why = _triton_keys_constraint(c, p)
    if why is not None:
        return why
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    if c["TMA"] and capability() < (9, 0):
        return "TMA needs sm90 or newer"
    bd = triton.next_power_of_2(p.D)
    if dtype == torch.float32 and (bm > 64 or bn > 64):
        return "fp32 takes the FMA path (ieee dots): tiles of at most 64 x 64"
    # the accumulator and one score tile per thread; scores one block ahead hold a second score tile
    per_thread = (bm * bd + (2 if c["SCHEDULE"] == "ahead" else 1) * bm * bn) // (32 * c["num_warps"])
    if per_thread > 192:
        return f"{per_thread} float32 accumulators/scores per thread (register spills)"
    if smem_bytes(c, p.D, dtype) > smem_limit():
        return f"needs {smem_bytes(c, p.D, dtype)} B of shared memory (budget {smem_limit()})"
    return None


SPACE.constraint = _constraint


def _default_tiles(p, dtype) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of :func:`default_config`."""
    bd = triton.next_power_of_2(p.D)
    if dtype == torch.float32:
        bm, bn, warps, stages = 64, 32, 4, 2
    elif bd <= 64:
        bm, bn, warps, stages = 128, 64, 8, 3
        if p.B * p.Hq * triton.cdiv(p.Tq, 128) < 512:
            bm, warps = 64, 4
    elif bd <= 128:
        bm, bn, warps, stages = 128, 128, 8, 3
    else:
        bm, bn, warps, stages = 128, 64, 8, 2
    bm = min(bm, max(16, triton.next_power_of_2(p.Tq)))
    bn = min(bn, max(16, triton.next_power_of_2(p.Tk)))
    while warps > 2 and bm < 8 * warps:
        warps //= 2
    return bm, bn, warps, stages


def default_config(p, dtype) -> dict:
    """Measured on an H100 (bf16, triton 3.6): 128-row tiles on two warpgroups (8 warps), three stages;
    64-key blocks at D <= 64, 128-key blocks above. Fewer than ~4 waves of 128-row programs (one long
    sequence of a small model): 64-row tiles on one warpgroup, twice the programs. HEADS_INNER keeps all
    heads' row blocks together only while every head's K/V fits in L2 together; past that, one head's
    row blocks run side by side and share its K/V in L2 (1.3x at 4 x 32 heads x 4096, D=128). fp32 takes
    the FMA path (ieee dots): small tiles. Head dims past 128 (a 256-wide fp32 accumulator): 64-key
    blocks, two stages. On sm90+ fp16/bf16 takes the TMA path: host-built descriptors at D <= 128 (they won
    17 of the 20 rows of an H100 sweep of FA3's grid, 1.02-1.16x over the pointer path), per-program ones
    for 8k queries and more past that."""
    bm, bn, warps, stages = _default_tiles(p, dtype)
    kv_bytes = 2 * p.B * p.Hkv * p.Tk * p.D * (torch.finfo(dtype).bits // 8)
    hopper = dtype != torch.float32 and capability() >= (9, 0)
    tma = (2 if triton.next_power_of_2(p.D) <= 128 else int(p.Tq >= 8192)) if hopper else 0
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
           "HEADS_INNER": int(kv_bytes <= 32 << 20), "TMA": tma, "IMPL": "triton", "SCHEDULE": "pipelined",
           "PERSISTENT": 0, "LAZY_RESCALE": 0}
    while SPACE.constraint(cfg, p, dtype) and cfg["num_stages"] > 1:
        cfg["num_stages"] -= 1
    while SPACE.constraint(cfg, p, dtype) and cfg["BLOCK_N"] > 16:  # D=256 with few warps: smaller key blocks
        cfg["BLOCK_N"] //= 2
    return cfg


def varlen_default_config(p, dtype) -> dict:
    """As dense, but every sequence's last row blocks first (HEADS_INNER=1) whatever the K/V size: in a
    packed batch most programs of the short sequences exit at once, and the tail is set by the longest
    sequence's row blocks, which HEADS_INNER=0 would start late (the H100 benchmark batch took 219 µs
    with 0, 138 µs with 1 and 4 warps)."""
    # the pointer path: the engine's prefill batches (packed prompts of up to a few thousand tokens) are
    # where the serving numbers were measured with it; TMA for varlen is a config to tune, not a default
    return {**default_config(p, dtype), "HEADS_INNER": 1, "TMA": 0, "SCHEDULE": "pipelined"}


_OLD_GLUON_SCHEDULES = ("ahead", "intra_wg", "pingpong")   # the Gluon kernel's schedules 0, 1, 2 by number


def gluon_config(p, dtype, schedule: str | int = "pingpong", BLOCK_N: int | None = None, num_stages: int = 2,
                 persistent: bool = False, BLOCK_M: int = G.ROWS) -> dict:
    """The point of the space that runs the Gluon kernel with ``schedule`` (a name of SCHEDULES["gluon"], or
    its number 0-2), its key tile (default: 128 up to D=128, 64 past it), ring depth, persistent form and CTA
    rows (128: two consumer warpgroups, 192: three); the keys it does not read at their one value. Not checked
    against the problem (``SPACE.why_invalid`` says)."""
    name = _OLD_GLUON_SCHEDULES[schedule] if isinstance(schedule, int) and 0 <= schedule < 3 else schedule
    if name not in SCHEDULES["gluon"] or (persistent and name not in PERSISTENT_SCHEDULES):
        raise ValueError(f"schedule: the {'persistent ' if persistent else ''}Gluon kernel has no schedule "
                         f"{schedule!r}")
    bn = BLOCK_N or (128 if triton.next_power_of_2(p.D) <= 128 else 64)
    return dict(default_config(p, dtype), BLOCK_M=BLOCK_M, num_warps=4, HEADS_INNER=0, TMA=2, LAZY_RESCALE=0,
                IMPL="gluon", SCHEDULE=name, PERSISTENT=int(bool(persistent)), BLOCK_N=bn, num_stages=num_stages)


def gluon_seeds(p, dtype) -> list[dict]:
    """Every tuning study's way into the Gluon kernel (IMPL=gluon fixes five keys at once, which no one-step
    move reaches): FA3's two schedules at the tile that won most of FA3's grid on the H200 (the default key
    tile; 3 stages where they fit, else 2). The tuner skips those the problem refuses."""
    bn = gluon_config(p, dtype)["BLOCK_N"]
    stages = 3 if G.smem_bytes(p.D, bn, 3) <= smem_limit() else 2
    # the persistent form (dense only): the deepest ring up to 4 that fits beside its four Q buffers (4 stages
    # won its 1k-2k rows at D=64 on the H200)
    p_stages = max([st for st in (2, 3, 4) if G.smem_bytes(p.D, bn, st, persistent=True) <= smem_limit()],
                   default=2)
    # FA3's CTA at D <= 64: three consumer warpgroups over 192 query rows, the ping-pong schedule
    return [gluon_config(p, dtype, schedule, num_stages=stages) for schedule in ("intra_wg", "pingpong")] + [
        gluon_config(p, dtype, "intra_wg", num_stages=p_stages, persistent=True),
        gluon_config(p, dtype, "pingpong", num_stages=3, BLOCK_M=G.ROWS3)]
