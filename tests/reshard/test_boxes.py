"""Boxes: the geometry every plan is made of."""

from hypothesis import given
from hypothesis import strategies as st

from liver.reshard.boxes import contains, disjoint_cover, intersect, split, volume


def test_intersection_of_overlapping_boxes_is_their_common_part():
    assert intersect(((0, 4), (0, 8)), ((2, 6), (4, 10))) == ((2, 4), (4, 8))


def test_boxes_that_only_touch_do_not_intersect():
    assert intersect(((0, 4),), ((4, 8),)) is None


def test_scalar_box_has_volume_one():
    assert volume(()) == 1


@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=3),
    st.integers(1, 50),
)
def test_split_pieces_cover_the_box_exactly_and_respect_the_limit(shape, limit):
    box = tuple((0, n) for n in shape)
    pieces = split(box, limit)
    assert disjoint_cover(box, pieces) is None
    assert all(volume(p) <= max(limit, 1) for p in pieces)


def test_cover_reports_a_gap():
    assert "elements" in disjoint_cover(((0, 4),), [((0, 2),)])


def test_cover_reports_an_overlap_even_when_volumes_add_up():
    assert "overlap" in disjoint_cover(((0, 4),), [((0, 3),), ((2, 3),)])


def test_cover_reports_overlap_in_two_dimensions():
    reason = disjoint_cover(((0, 2), (0, 2)), [((0, 2), (0, 1)), ((0, 1), (0, 2))])
    assert reason is not None


def test_cover_rejects_a_slice_outside_the_shard():
    assert "outside" in disjoint_cover(((0, 4),), [((2, 6),)])


def test_containment():
    assert contains(((0, 4), (0, 4)), ((1, 2), (0, 4)))
    assert not contains(((0, 4),), ((3, 5),))
