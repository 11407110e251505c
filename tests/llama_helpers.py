"""What the Llama-family tests share: random weights wide enough that greedy outputs vary, prompts, greedy
decoding through a model's own prefill and paged decode, and transformers' greedy tokens with the steps
whose choice is clear (top-2 logit gap over 1e-3)."""
import torch

from tests.test_engine import alone

VOCAB = 97


def randomize(m) -> None:
    """Norm weights around 1, matrices N(0, 0.25), vectors N(0, 0.05), in place."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.25 if p.dim() == 2 else 0.05)


def prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# greedy tokens through a model's own prefill and paged decode over a private cache (block size 4): the
# engine tests' independent path, which takes any family's model
greedy = alone


def hf_greedy(hf, p, max_new):
    """transformers' greedy tokens and, per step, whether its top-2 logit gap exceeds 1e-3 (a clear choice)."""
    with torch.no_grad():
        g = hf.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                        output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    toks = g.sequences[0, len(p):].tolist()
    clear = [bool((lg[0].topk(2).values[0] - lg[0].topk(2).values[1]) > 1e-3) for lg in g.logits]
    return toks, clear


def assert_same_greedy(ours, theirs, clear):
    """Equal token for token; a step whose choice transformers makes by less than 1e-3 may differ, and
    the sequences are compared no further after such a difference."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert not clear[i], f"step {i}: {a} != {b} with a clear top-2 gap ({ours} vs {theirs})"
            assert i >= len(clear) // 2, f"diverged at a near-tie after only {i} tokens ({ours} vs {theirs})"
            return
    assert len(ours) == len(theirs)
