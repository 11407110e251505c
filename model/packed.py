"""What a family's ``prefill`` checks and derives from a packed batch, written once for every family."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor      # (T,) int64 on the model's device
    seq_lens: list[int]
    positions: torch.Tensor      # (T,) on the model's device
    slot_mapping: torch.Tensor | None
    cu: list[int]                # [0, n0, n0 + n1, ...]
    cu_seqlens: torch.Tensor     # int32, on the device
    max_seqlen: int


def packed(input_ids, seq_lens, positions, kv_cache, slot_mapping, *, device, n_positions: int) -> Packed:
    """``input_ids`` (T,) the concatenation of ``seq_lens`` sequences: checked (lengths positive, summing to
    T, each within ``n_positions``; ``slot_mapping`` given, one slot per token, when there is a cache), then
    positions (0.. within each sequence unless given) and the cumulative lengths the varlen kernels take."""
    seq_lens = [int(n) for n in seq_lens]
    input_ids = torch.as_tensor(input_ids, device=device).long().reshape(-1)
    t = input_ids.numel()
    if not seq_lens or min(seq_lens) < 1 or sum(seq_lens) != t:
        raise ValueError(f"seq_lens: expected positive lengths summing to len(input_ids)={t}, got {seq_lens}")
    if max(seq_lens) > n_positions:
        raise ValueError(f"seq_lens: a sequence of {max(seq_lens)} tokens exceeds n_positions={n_positions}")
    if positions is None:
        positions = torch.cat([torch.arange(n) for n in seq_lens])
    positions = torch.as_tensor(positions, device=device).reshape(-1)
    if kv_cache is not None:
        if slot_mapping is None:
            raise ValueError("slot_mapping: required with kv_cache")
        slot_mapping = torch.as_tensor(slot_mapping, device=device).reshape(-1)
        if slot_mapping.numel() != t:
            raise ValueError(f"slot_mapping: expected {t} slots, got {slot_mapping.numel()}")
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    return Packed(input_ids, seq_lens, positions, slot_mapping, cu,
                  torch.tensor(cu, dtype=torch.int32, device=device), max(seq_lens))
