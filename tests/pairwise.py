"""A pairwise covering subset of a parametrized test's items, for the fast GPU suite.

Each item of a big parameter matrix compiles its own kernel variants. The fast suite keeps a subset of a
``pairwise``-marked test's items in which every two parameter values that meet in some item still meet in a kept
one (every value of a one-parameter test is kept); the other items are marked slow, so ``-m slow`` runs them and
the two suites together still run the whole matrix.
"""
from __future__ import annotations

from itertools import combinations

import pytest


def _pairs(params: dict) -> set:
    """The item's (name, value) entries and their pairs; values told apart by ``repr``."""
    entries = sorted((name, repr(value)) for name, value in params.items())
    return {(e,) for e in entries} | set(combinations(entries, 2))


def covering(items_params: list[dict]) -> list[int]:
    """Indices, in collection order, of items whose parameters cover every pair of (name, value) entries that
    occur together in some item of ``items_params`` (and every single entry). Greedy and deterministic: the
    item covering the most pairs not yet covered, the earliest on a tie, until none is left. Items without
    parameters keep the first one."""
    sets = [_pairs(p) for p in items_params]
    left = set().union(*sets)
    if not left:
        return [0] if sets else []
    chosen = []
    while left:
        best = max(range(len(sets)), key=lambda i: (len(sets[i] & left), -i))
        chosen.append(best)
        left -= sets[best]
    return sorted(chosen)


def mark_beyond_pairwise(items) -> None:
    """Mark slow the items of each ``pairwise``-marked test outside the covering subset of its items that are
    not slow already (those the slow suite runs whatever the pairs). Items are grouped by node id without the
    parameter part; their parameters are ``callspec.params`` (pytest 9's ``callspec.indices`` numbers the
    items of the product, not each list's values). ``@pytest.mark.pairwise(runs=f)``: ``f(**params)`` says
    whether an item runs on this machine (False: it will skip); the pairs are those of the items that run, and
    the items that will skip go to the slow suite with the rest (the default suite lists no skip for them)."""
    groups: dict[str, list] = {}
    for item in items:
        if (item.get_closest_marker("pairwise") and not item.get_closest_marker("slow")
                and getattr(item, "callspec", None) is not None):
            groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    for group in groups.values():
        runs = group[0].get_closest_marker("pairwise").kwargs.get("runs")
        running = [item for item in group if runs is None or runs(**item.callspec.params)]
        kept = {id(running[i]) for i in covering([item.callspec.params for item in running])}
        for item in group:
            if id(item) not in kept:
                item.add_marker(pytest.mark.slow)
