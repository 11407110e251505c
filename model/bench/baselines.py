"""serve-bench's baselines on the same workload and model: ``transformers`` ``generate`` in static
batches, and naive single-request inference without a KV cache."""
from __future__ import annotations

import time

from tritune.model.bench.runs import progress, sync

def run_hf(hf, items, batch_size, limit, *, show_progress: bool = False) -> dict:
    """transformers generate, static batches in arrival order, left-padded, each to its longest output."""
    import torch

    sub = items[:limit] if limit else items
    pad = 0
    useful = 0
    dev = next(hf.parameters()).device
    with torch.inference_mode():     # warm-up at the timed batch size: kernels, allocator, generate's setup
        w = [it.prompt_ids for it in sub[:batch_size]]
        L = max(map(len, w))
        hf.generate(input_ids=torch.tensor([[pad] * (L - len(p)) + p for p in w], device=dev),
                    attention_mask=torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in w], device=dev),
                    max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=pad)
    sync()
    t0 = time.perf_counter()
    bar = progress(sum(it.output_len for it in sub), "transformers", show=show_progress)
    for s in range(0, len(sub), batch_size):
        batch = sub[s:s + batch_size]
        L = max(len(it.prompt_ids) for it in batch)
        new = max(it.output_len for it in batch)
        ids = torch.full((len(batch), L), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, it in enumerate(batch):
            ids[i, L - len(it.prompt_ids):] = torch.tensor(it.prompt_ids)
            mask[i, L - len(it.prompt_ids):] = 1
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=pad)
        useful += sum(it.output_len for it in batch)
        bar.update(sum(it.output_len for it in batch))
    bar.close()
    sync()
    el = time.perf_counter() - t0
    out_tok_s = useful / el
    total = sum(it.output_len for it in items)
    return {"batch_size": batch_size, "requests_timed": len(sub), "elapsed_s": el, "output_tokens": useful,
            "output_tok_s": out_tok_s, "extrapolated_elapsed_s": total / out_tok_s,
            "note": None if len(sub) == len(items) else
            f"timed the first {len(sub)} of {len(items)} requests; elapsed for all extrapolated at that rate"}


def run_naive(hf, items, n, max_new, *, show_progress: bool = False) -> dict:
    """Single request, no KV cache: every token re-runs the whole sequence (HF forward, use_cache=False)."""
    import torch

    dev = next(hf.parameters()).device
    toks = 0
    p0 = items[0].prompt_ids
    with torch.inference_mode():     # warm-up: kernels and allocator at the lengths timed below
        for L in (len(p0), len(p0) + max_new):
            hf(torch.tensor([(p0 * (L // len(p0) + 1))[:L]], device=dev), use_cache=False)
    sync()
    t0 = time.perf_counter()
    total = sum(min(max_new, it.output_len) for it in items[:n])
    with torch.inference_mode(), progress(total, "naive", show=show_progress) as bar:
        for it in items[:n]:
            ids = torch.tensor([it.prompt_ids], device=dev)
            for _ in range(min(max_new, it.output_len)):
                logits = hf(ids, use_cache=False).logits[:, -1]
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
                toks += 1
            int(ids[0, -1])
            bar.update(min(max_new, it.output_len))
    sync()
    el = time.perf_counter() - t0
    return {"requests": min(n, len(items)), "tokens": toks, "elapsed_s": el, "output_tok_s": toks / el,
            "note": f"first {max_new} output tokens of each request (shorter sequences than the full outputs, "
                    "which flatters naive)"}
