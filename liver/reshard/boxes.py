"""Hyper-rectangles of global tensor indices.

A box is a tuple of half-open ``(lo, hi)`` intervals, one per dimension. Plain tuples (not objects)
keep the planner fast: a 175B-parameter plan handles hundreds of thousands of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Interval = tuple[int, int]
Box = tuple[Interval, ...]


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or ``None`` when it is empty."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def volume(box: Box) -> int:
    """Number of elements in ``box`` (1 for the box of a scalar)."""
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def extent(box: Box) -> tuple[int, ...]:
    """The shape of the sub-tensor that ``box`` selects."""
    return tuple(hi - lo for lo, hi in box)


def contains(outer: Box, inner: Box) -> bool:
    """Whether ``inner`` lies entirely within ``outer``."""
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner))


def relative(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices that select ``box`` from a local tensor whose index 0 is ``origin``'s lower corner."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def split(box: Box, max_elements: int) -> list[Box]:
    """Cut ``box`` into pieces of at most ``max_elements`` elements, along its outermost dimensions.

    Pieces stay boxes (so a receiver can write each one as a strided slice) and keep row-major order.
    """
    if max_elements < 1:
        raise ValueError("max_elements must be at least 1")
    if volume(box) <= max_elements:
        return [box]
    if not box:
        return [box]
    (lo, hi), rest = box[0], box[1:]
    inner = volume(rest)
    if inner <= max_elements:
        rows = max(1, max_elements // inner)
        return [((s, min(s + rows, hi)), *rest) for s in range(lo, hi, rows)]
    pieces: list[Box] = []
    for i in range(lo, hi):
        pieces.extend(((i, i + 1), *sub) for sub in split(rest, max_elements))
    return pieces


def disjoint_cover(target: Box, parts: Iterable[Box]) -> str | None:
    """Check that ``parts`` cover ``target`` exactly once; return a reason when they do not.

    Containment plus pairwise disjointness plus equal total volume is an exact cover.
    """
    parts = list(parts)
    total = 0
    for p in parts:
        if not contains(target, p):
            return f"slice {p} lies outside the shard {target}"
        total += volume(p)
    if total != volume(target):
        return f"slices hold {total} elements but the shard has {volume(target)}"
    if len(parts) > 1:
        ordered = sorted(parts)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                if b[0][0] >= a[0][1]:
                    break
                if intersect(a, b) is not None:
                    return f"slices {a} and {b} overlap"
    return None
