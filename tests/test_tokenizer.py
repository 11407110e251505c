"""IncrementalDecoder against decoding the whole output after every token (what it replaced), on random
token ids of the packaged tokenizer, multi-byte characters split across tokens and bytes that are no
character included.

Micro-benchmark (python -m tests.test_tokenizer; a shared 2-core CPU, random ids of
model/default/tokenizer.json): 200 tokens 2.2 us/token (re-decoding everything: 19 us), 1000 tokens
1.8 us/token (58 us), a 1000-token U+FFFD run (lone continuation bytes, held throughout) 2.7 us/token (51 us).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from tritune.model.tokenizer import IncrementalDecoder, Tokenizer

TOK = Tokenizer.from_dir(Path(__file__).resolve().parents[1] / "model" / "default")
V = TOK.vocab_size
# ids whose text alone is not a character (parts of multi-byte UTF-8 sequences), and ids of real
# multi-byte text: what a uniform draw over 8192 ids rarely puts side by side
PARTIAL = [i for i in range(V) if "\ufffd" in TOK.decode([i])]
MULTI = sorted(set(TOK.encode("héllo wörld 日本語 😀🎉 Ελληνικά naïve café ∑∫ ﬁ \u200d 👩\u200d💻 \ufffd")))

ids_st = st.lists(st.one_of(st.integers(0, V - 1), st.sampled_from(PARTIAL), st.sampled_from(MULTI)),
                  max_size=60)


def whole_decode_pieces(ids) -> list[str]:
    """The pieces of the decoder it replaced: the whole output decoded after every token, what is new
    emitted unless the text ends in U+FFFD."""
    text, pieces = "", []
    for n in range(1, len(ids) + 1):
        full = TOK.decode(ids[:n])
        if full.endswith("\ufffd"):
            pieces.append("")
            continue
        pieces.append(full[len(text):])
        assert full.startswith(text)
        text = full
    return pieces


def _check(ids, hold=None):
    dec = IncrementalDecoder(TOK)
    if hold is not None:
        dec.HOLD = hold
    got = [dec.push(i) for i in ids]
    assert got == whole_decode_pieces(ids)          # the same piece after every token
    rest = dec.flush()
    assert "".join(got) + rest == TOK.decode(ids)
    assert dec.text == TOK.decode(ids)


@settings(max_examples=300, deadline=None)
@given(ids_st, st.sampled_from([None, 1, 2, 5]))
def test_pushes_match_decoding_everything(ids, hold):
    _check(ids, hold)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_encoded_text_comes_back(text):
    ids = TOK.encode(text)
    _check(ids)
    _check(ids, 1)


@pytest.mark.parametrize("hold", [None, 1, 3])
def test_runs_of_bytes_that_are_no_character(hold):
    """Lone continuation bytes and cut sequences: U+FFFD runs longer than HOLD, then a character."""
    # PARTIAL holds the 128 single bytes >= 0x80 in byte order: 0x80-0xBF continue, 0xC2-0xF4 lead
    _check(PARTIAL * 2 + TOK.encode("a"), hold)
    _check(PARTIAL[:5] * 7 + MULTI + PARTIAL[3:9] * 4, hold)
    _check(PARTIAL[-20:] * 5 + PARTIAL[:20] * 3, hold)
    _check([PARTIAL[0]] * 40, hold)


def test_window_stays_short():
    """The cost per token is O(1): the decoded window never grows with the output, even through a long
    run of U+FFFD."""
    dec = IncrementalDecoder(TOK)
    longest = 0
    for i in (list(range(300, 700)) + [PARTIAL[0]] * 200 + list(range(700, 900))):
        dec.push(i)
        longest = max(longest, len(dec.ids) - dec._prefix)
    assert longest <= 2 * dec.HOLD + 2, longest


def _bench(ids) -> tuple[float, float]:
    t0 = time.perf_counter()
    dec = IncrementalDecoder(TOK)
    for i in ids:
        dec.push(i)
    t1 = time.perf_counter()
    whole_decode_pieces(ids)
    t2 = time.perf_counter()
    return (t1 - t0) / len(ids) * 1e6, (t2 - t1) / len(ids) * 1e6


if __name__ == "__main__":
    import random

    rng = random.Random(0)
    for name, ids in (("random 200", [rng.randrange(V) for _ in range(200)]),
                      ("random 1000", [rng.randrange(V) for _ in range(1000)]),
                      ("U+FFFD run 1000", [PARTIAL[0]] * 1000)):
        new, old = _bench(ids)
        print(f"{name:>16}: {new:6.1f} us/token (whole decode: {old:6.1f})")
