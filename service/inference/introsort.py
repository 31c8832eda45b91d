"""libstdc++'s ``std::sort``, replayed step by step, for Triton's tie order.

Triton's classification sorts class indices with ``std::sort`` and the
comparison ``probs[a] > probs[b]``. ``std::sort`` is not stable: which of two
equal scores comes first depends on the algorithm's every swap. Triton is
built with GCC, so this is libstdc++'s introsort (``bits/stl_algo.h`` and
``bits/stl_heap.h``): median-of-three quicksort down to runs of 16, a heap
sort past a depth of 2 log2(n), then one insertion sort over the whole. The
result equals the C++ one element for element, NaN included (a NaN compares
false both ways, in Python as in C++): ``tests/test_classification.py``
checks it against a compiled ``std::sort`` where a C++ compiler is present.

Pure Python, about a microsecond per element: :mod:`classification` calls it
only when equal values (or NaN) decide the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

_THRESHOLD = 16  # libstdc++'s _S_threshold


def triton_sort(values: Sequence[float]) -> list[int]:
    """The indices of ``values`` as ``std::sort(idx, idx + n, probs[a] > probs[b])``
    leaves them."""
    idx = list(range(len(values)))
    n = len(idx)
    if n > 1:
        _introsort_loop(idx, values, 0, n, 2 * (n.bit_length() - 1))
        _final_insertion_sort(idx, values, 0, n)
    return idx


def _introsort_loop(idx: list[int], v: Sequence[float], first: int, last: int, depth: int) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            _heap_sort(idx, v, first, last)
            return
        depth -= 1
        cut = _partition_pivot(idx, v, first, last)
        _introsort_loop(idx, v, cut, last, depth)
        last = cut


def _partition_pivot(idx: list[int], v: Sequence[float], first: int, last: int) -> int:
    mid = first + (last - first) // 2
    _median_to_first(idx, v, first, first + 1, mid, last - 1)
    return _unguarded_partition(idx, v, first + 1, last, first)


def _median_to_first(
    idx: list[int], v: Sequence[float], result: int, a: int, b: int, c: int
) -> None:
    va, vb, vc = v[idx[a]], v[idx[b]], v[idx[c]]
    if va > vb:
        if vb > vc:
            pick = b
        elif va > vc:
            pick = c
        else:
            pick = a
    elif va > vc:
        pick = a
    elif vb > vc:
        pick = c
    else:
        pick = b
    idx[result], idx[pick] = idx[pick], idx[result]


def _unguarded_partition(
    idx: list[int], v: Sequence[float], first: int, last: int, pivot: int
) -> int:
    p = v[idx[pivot]]
    while True:
        while v[idx[first]] > p:
            first += 1
        last -= 1
        while p > v[idx[last]]:
            last -= 1
        if not first < last:
            return first
        idx[first], idx[last] = idx[last], idx[first]
        first += 1


def _final_insertion_sort(idx: list[int], v: Sequence[float], first: int, last: int) -> None:
    if last - first > _THRESHOLD:
        _insertion_sort(idx, v, first, first + _THRESHOLD)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(idx, v, i)
    else:
        _insertion_sort(idx, v, first, last)


def _insertion_sort(idx: list[int], v: Sequence[float], first: int, last: int) -> None:
    for i in range(first + 1, last):
        if v[idx[i]] > v[idx[first]]:
            moved = idx[i]
            idx[first + 1 : i + 1] = idx[first:i]
            idx[first] = moved
        else:
            _unguarded_linear_insert(idx, v, i)


def _unguarded_linear_insert(idx: list[int], v: Sequence[float], last: int) -> None:
    moved = idx[last]
    value = v[moved]
    before = last - 1
    while value > v[idx[before]]:
        idx[last] = idx[before]
        last = before
        before -= 1
    idx[last] = moved


# --- std::__partial_sort(first, last, last): make_heap, then sort_heap ----------


def _heap_sort(idx: list[int], v: Sequence[float], first: int, last: int) -> None:
    length = last - first
    if length >= 2:
        parent = (length - 2) // 2
        while True:
            _adjust_heap(idx, v, first, parent, length, idx[first + parent])
            if parent == 0:
                break
            parent -= 1
    while last - first > 1:
        last -= 1
        moved = idx[last]
        idx[last] = idx[first]
        _adjust_heap(idx, v, first, 0, last - first, moved)


def _adjust_heap(
    idx: list[int], v: Sequence[float], first: int, hole: int, length: int, moved: int
) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if v[idx[first + child]] > v[idx[first + child - 1]]:
            child -= 1
        idx[first + hole] = idx[first + child]
        hole = child
    if length & 1 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        idx[first + hole] = idx[first + child - 1]
        hole = child - 1
    # std::__push_heap
    value = v[moved]
    parent = (hole - 1) // 2
    while hole > top and v[idx[first + parent]] > value:
        idx[first + hole] = idx[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[first + hole] = moved
