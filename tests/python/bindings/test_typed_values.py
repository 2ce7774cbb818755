"""The tree's fixed-shape values cross the binding as struct sequences: a copy
between the tiers (TierCopy), the tier sizes (TierSizes) and a dump's rows
(DumpRow, DumpRowNs, TierDumpRow, TierDumpRowNs). Each is a tuple, so
positional callers keep working, and each field has a name; a plain tuple is
still taken wherever a copy comes back."""

import copy as copy_module
import pickle

import pytest

from radixkv import _core


def _tree_with_copies():
    """A tree with a finished backup of [0, 10) and a second path beside it."""
    t = _core.RadixTree(1)
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    t.insert_prefix(list(range(6)) + [99, 98], list(range(100, 106)) + [200, 201])
    c = t.find_backup(list(range(10)))
    t.begin_backup(c)
    assert len(t.finish_backup(c, list(range(10)))) == 0
    return t


def test_a_copy_is_a_tier_copy_whose_fields_are_its_positions():
    t = _core.RadixTree(1)
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    c = t.find_backup(list(range(10)))
    assert type(c) is _core.TierCopy and isinstance(c, tuple) and len(c) == 4
    assert (c.node_id, c.incarnation, c.start, c.end) == tuple(c) == (c[0], c[1], c[2], c[3])
    assert (c.start, c.end) == (0, 10)
    node_id, incarnation, start, end = c  # unpacks as a tuple
    assert c == (node_id, incarnation, start, end) and hash(c) == hash(tuple(c))
    assert _core.TierCopy.__match_args__ == ("node_id", "incarnation", "start", "end")
    match c:
        case _core.TierCopy(start=0, end=e):
            assert e == 10
        case _:
            pytest.fail("a TierCopy matches by field name")
    with pytest.raises(AttributeError):
        c.start = 3  # read-only, as a tuple is


def test_the_incarnation_survives_moves_between_tiers_and_changes_with_the_id():
    """copy.incarnation is the node's incarnation, not its generation: the
    node going host only makes a handle to it stale (its generation moves)
    but keeps its incarnation; only freeing the id gives a new one."""
    t = _core.RadixTree(1)
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    backup = t.find_backup(list(range(10)))
    t.begin_backup(backup)
    t.finish_backup(backup, list(range(10)))
    h, _ = t.match_prefix(list(range(10)))
    t.evict(10)  # host only now
    assert not t.is_valid(h)
    h, _ = t.match_prefix(list(range(10)))
    load = t.find_load(h)
    assert (load.node_id, load.incarnation) == (backup.node_id, backup.incarnation)
    assert (load.start, load.end) == (0, 10)
    assert len(t.evict_host(10)) == 10  # the node is freed
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    again = t.find_backup(list(range(10)))
    assert again.node_id == backup.node_id  # the id is reused...
    assert again.incarnation == backup.incarnation + 1  # ...in a new incarnation
    with pytest.raises(ValueError, match="stale"):
        t.begin_backup(backup)  # the old copy names the dead incarnation
    t.check_integrity()


def test_tier_sizes_is_a_tuple_with_the_tree_s_field_names():
    t = _tree_with_copies()
    s = t.tier_sizes()
    assert type(s) is _core.TierSizes and isinstance(s, tuple) and len(s) == 7
    names = (
        "device_evictable",
        "device_protected",
        "host",
        "host_only",
        "backing_up",
        "loading",
        "storage_writing",
    )
    assert _core.TierSizes.__match_args__ == names
    assert tuple(getattr(s, n) for n in names) == tuple(s)
    assert (s.device_evictable, s.host, s.host_only) == (12, 10, 0)
    ev, prot, *_ = s
    assert (ev, prot) == s[:2] == (12, 0)
    t.evict(12)
    s = t.tier_sizes()
    assert (s.device_evictable, s.host, s.host_only) == (0, 10, 10)


@pytest.mark.parametrize(
    "tiers,namespaces,type_name,fields",
    [
        (False, False, "DumpRow", ("parent", "tokens", "device_slots", "ref_count", "timestamp")),
        (
            False,
            True,
            "DumpRowNs",
            ("parent", "tokens", "device_slots", "ref_count", "timestamp", "namespace"),
        ),
        (
            True,
            False,
            "TierDumpRow",
            ("parent", "tokens", "device_slots", "host_slots", "ref_count", "timestamp"),
        ),
        (
            True,
            True,
            "TierDumpRowNs",
            (
                "parent",
                "tokens",
                "device_slots",
                "host_slots",
                "ref_count",
                "timestamp",
                "namespace",
            ),
        ),
    ],
)
def test_dump_rows_are_tuples_whose_fields_are_their_positions(
    tiers, namespaces, type_name, fields
):
    t = _tree_with_copies()
    t.insert_prefix([7, 8], [300, 301], 0, 5)
    rows = t.dump(tiers, namespaces)
    assert len(rows) == 4
    for row in rows:
        assert type(row) is getattr(_core, type_name) and isinstance(row, tuple)
        assert len(row) == len(fields) == type(row).n_sequence_fields
        assert tuple(getattr(row, f) for f in fields) == tuple(row)
        assert type(row).__match_args__ == fields
    by_tokens = {tuple(r.tokens): r for r in rows}
    # Every row has every name (the namespace by name too when not in the tuple).
    assert by_tokens[(7, 8)].namespace == 5 and by_tokens[(0, 1, 2, 3, 4, 5)].namespace == 0
    assert by_tokens[(7, 8)].device_slots == [300, 301]
    assert by_tokens[(7, 8)].parent == -1 and by_tokens[(6, 7, 8, 9)].parent >= 0
    if tiers:
        assert by_tokens[(6, 7, 8, 9)].host_slots == [6, 7, 8, 9]
        assert by_tokens[(7, 8)].host_slots == []
    # Equal to plain tuples, and to the namespaced rows less their namespace.
    assert rows == [tuple(r) for r in rows]
    if not namespaces:
        assert t.dump(tiers, True) == [tuple(r) + (r.namespace,) for r in rows]


def test_a_plain_tuple_is_taken_back_wherever_a_copy_is():
    t = _core.RadixTree(1)
    t.insert_prefix(list(range(10)), list(range(100, 110)))
    c = t.find_backup(list(range(10)))
    t.begin_backup(tuple(c))
    assert len(t.finish_backup(tuple(c), list(range(10)))) == 0
    t.evict(10)
    h, _ = t.match_prefix(list(range(10)))
    load = t.find_load(h)
    _, host_slots, prefix = t.begin_load(tuple(load))
    assert t.finish_load(
        (load.node_id, load.incarnation, load.start, load.end), list(range(200, 210))
    )
    pin = t.pin_host(list(range(5)))
    assert type(pin) is _core.TierCopy and pin.start == 5
    t.unpin_host(tuple(pin))
    assert t.host_pins == 0
    began = t.begin_storage_write(tuple(c))
    assert began is not None and type(began[0]) is _core.TierCopy
    t.finish_storage_write(tuple(began[0]))
    assert t.tier_sizes().storage_writing == 0
    t.check_integrity()


def test_a_copy_that_is_not_a_four_tuple_is_refused_naming_the_fields():
    t = _tree_with_copies()
    for bad in ([1, 0, 0, 10], (1, 0, 0), None):
        with pytest.raises(TypeError, match=r"TierCopy \(node_id, incarnation, start, end\)"):
            t.begin_backup(bad)
    with pytest.raises(TypeError, match="copy.incarnation"):
        t.begin_backup((1, "x", 0, 10))
    with pytest.raises(ValueError, match="copy.node_id"):
        t.begin_backup((-1, 0, 0, 10))


def test_typed_values_pickle_copy_and_repr():
    t = _tree_with_copies()
    t.insert_prefix([7, 8], [300, 301], 0, 5)
    c = t.find_backup(list(range(6)) + [99, 98], through_partial=True)
    values = [c, t.tier_sizes()] + t.dump() + t.dump(True) + t.dump(True, True)
    for v in values:
        for back in (pickle.loads(pickle.dumps(v)), copy_module.copy(v), copy_module.deepcopy(v)):
            assert type(back) is type(v) and back == v
    # The namespace a row has by name only is kept too.
    row = next(r for r in t.dump() if r.tokens == [7, 8])
    assert pickle.loads(pickle.dumps(row)).namespace == 5
    assert repr(c) == (
        f"radixkv._core.TierCopy(node_id={c.node_id}, "
        f"incarnation={c.incarnation}, start={c.start}, end={c.end})"
    )
    assert repr(t.tier_sizes()).startswith("radixkv._core.TierSizes(device_evictable=14, ")
    assert repr(row) == (
        "radixkv._core.DumpRow(parent=-1, tokens=[7, 8], "
        f"device_slots=[300, 301], ref_count=0, timestamp={row.timestamp})"
    )
    # Made from a sequence, as any struct sequence.
    assert _core.TierCopy((1, 2, 3, 4)).incarnation == 2
