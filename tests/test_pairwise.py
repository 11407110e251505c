"""The fast GPU suite's pairwise subsets (tests/pairwise.py): every pair covered, the same choice each time,
few items for a big matrix, and nothing marked under the interpreter."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from tritune.kernels.runtime import device as dev

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside the tests
from pairwise import covering, mark_beyond_pairwise  # noqa: E402


def _matrix(**values) -> list[dict]:
    names = list(values)
    return [dict(zip(names, combo)) for combo in itertools.product(*values.values())]


def _pairs_met(items: list[dict]) -> set:
    return {((a, repr(p[a])), (b, repr(p[b]))) for p in items for a, b in itertools.combinations(sorted(p), 2)}


MATRIX = _matrix(D=[32, 64, 80, 96, 128, 160, 192, 224, 256], schedule=[0, 1, 2], causal=[False, True],
                 dtype=[torch.bfloat16, torch.float16])


def test_every_pair_is_covered_by_few_items():
    chosen = covering(MATRIX)
    assert chosen == sorted(set(chosen))
    assert _pairs_met([MATRIX[i] for i in chosen]) == _pairs_met(MATRIX)
    assert 27 <= len(chosen) <= 30, len(chosen)   # 9 x 3 (D, schedule) pairs need 27 items


def test_the_choice_is_deterministic_and_follows_the_items_order():
    assert covering(MATRIX) == covering([dict(p) for p in MATRIX])
    assert covering([{"a": 0, "b": 0}, {"a": 0, "b": 0}]) == [0]   # a tie goes to the earlier item


def test_only_pairs_that_occur_are_asked_for():
    """A matrix with holes (points a space refuses): the pairs of the items there, no others."""
    items = [p for p in MATRIX if not (p["D"] > 128 and p["schedule"] == 0)]
    chosen = covering(items)
    assert _pairs_met([items[i] for i in chosen]) == _pairs_met(items)


def test_a_single_parameter_keeps_every_value_and_no_parameters_one_item():
    assert covering([{"st": s} for s in (1, 2, 3, 4)]) == [0, 1, 2, 3]
    assert covering([{}]) == [0]
    assert covering([]) == []


def test_unhashable_values_are_told_apart_by_repr():
    items = _matrix(hopper=[{"TMA": 0}, {"TMA": 1}, {"TMA": 2}], D=[64, 80], causal=[False, True])
    chosen = covering(items)
    assert _pairs_met([items[i] for i in chosen]) == _pairs_met(items)
    assert len(chosen) == 6


class _Item:
    """What mark_beyond_pairwise and mark_slow_and_gpu read of a collected item."""

    def __init__(self, nodeid: str, params: dict, marks=("pairwise",), runs=None):
        self.nodeid, self.marks, self.keywords = nodeid, list(marks), {}
        self.callspec = SimpleNamespace(params=params)
        self.runs = runs

    def get_closest_marker(self, name):
        if name not in self.marks:
            return None
        return SimpleNamespace(name=name, kwargs={} if self.runs is None else {"runs": self.runs})

    def add_marker(self, mark):
        self.marks.append(mark.name)


def _items(name="tests/test_x.py::test_m", **values) -> list[_Item]:
    return [_Item(f"{name}[{'-'.join(map(str, p.values()))}]", p) for p in _matrix(**values)]


def test_the_items_outside_the_subset_are_marked_slow_per_test():
    a = _items(D=range(9), s=range(3), c=range(2), t=range(2))
    b = _items("tests/test_x.py::test_n", D=range(3), s=range(3), c=range(2))
    plain = _items("tests/test_x.py::test_p", D=range(3), s=range(3), c=range(2))
    for it in plain:
        it.marks.remove("pairwise")
    mark_beyond_pairwise(a + b + plain)
    for group in (a, b):
        kept = [i for i, it in enumerate(group) if "slow" not in it.marks]
        assert kept == covering([it.callspec.params for it in group])
    assert not any("slow" in it.marks for it in plain)


def test_items_slow_already_are_left_to_the_slow_suite():
    """The pairs are covered among the fast suite's items: one slow already is neither chosen nor counted."""
    group = _items(dtype=range(3), D=range(4), layout=range(4))
    for it in group[:16]:   # dtype 0: slow by node id
        it.marks.append("slow")
    mark_beyond_pairwise(group)
    fast = [it for it in group if "slow" not in it.marks]
    assert _pairs_met([it.callspec.params for it in fast]) == _pairs_met([it.callspec.params for it in group[16:]])
    assert len(fast) == 16   # the 4 x 4 (D, layout) pairs


def test_the_hook_marks_nothing_under_the_interpreter(monkeypatch, request):
    """On the interpreter the whole matrix runs (CPU runs compile nothing); on a GPU the subset."""
    conftest = request.config.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    assert conftest is not None and hasattr(conftest, "mark_slow_and_gpu")
    for interpreted in (True, False):
        monkeypatch.setattr(dev, "interpreted", lambda: interpreted)
        items = _items("tests/test_pairwise_fake.py::test_m", D=range(4), s=range(3), c=range(2))
        conftest.mark_slow_and_gpu(items)
        slow = sum("slow" in it.marks for it in items)
        assert slow == 0 if interpreted else slow == len(items) - len(covering([it.callspec.params for it in items]))




def test_items_that_will_skip_are_left_out_of_the_pairs():
    """With ``pairwise(runs=f)``, the pairs are those of the items that run: an item that will skip covers
    nothing, and goes to the slow suite."""
    def runs(D, st, c):
        return not (D == 256 and st == 4)

    items = [_Item(f"t[{D}-{st}-{c}]", dict(D=D, st=st, c=c), runs=runs)
             for D in (64, 256) for st in (3, 4) for c in (0, 1)]
    mark_beyond_pairwise(items)
    fast = [it.callspec.params for it in items if "slow" not in it.marks]
    assert all(runs(**p) for p in fast)
    ran = fast
    for a, va, b, vb in [("D", 256, "c", 0), ("D", 256, "c", 1), ("st", 4, "c", 0), ("st", 4, "c", 1),
                         ("D", 256, "st", 3), ("D", 64, "st", 4)]:
        assert any(p[a] == va and p[b] == vb for p in ran), (a, va, b, vb)
