"""Decode grouping by context length (fewer padded keys in the batched decode attention)."""

from kvfleet.model.runner import _decode_groups


def test_groups_cover_all_rows_in_order():
    lens = sorted([3, 5, 7, 9, 40, 41, 45, 60, 300, 310, 320, 330, 700])
    groups = _decode_groups(lens)
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert 1 < len(groups) <= 4
    assert all(e - s >= 4 for s, e in groups[:-1])


def test_equal_lengths_and_small_batches_stay_one_group():
    assert _decode_groups([100] * 20) == [(0, 20)]
    assert _decode_groups([1, 100, 1000]) == [(0, 3)]
    assert _decode_groups([]) == []
