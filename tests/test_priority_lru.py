from __future__ import annotations

import pytest

from storage.priority_lru import PriorityLru


def filled() -> PriorityLru[str]:
    lru: PriorityLru[str] = PriorityLru()
    for key, weight, priority in [("a", 1, 0), ("b", 2, 5), ("c", 3, -1), ("d", 4, 5), ("e", 5, 0)]:
        lru.set(key, weight, priority)
    return lru


def test_highest_value_first_then_least_recently_used():
    lru = filled()
    assert list(lru) == ["b", "d", "a", "e", "c"]
    assert list(lru.values()) == [2, 4, 1, 5, 3]
    lru.move_to_end("b")
    lru.move_to_end("e", last=False)
    assert list(lru) == ["d", "b", "e", "a", "c"] and lru.first() == "d"


def test_set_again_is_most_recent_and_keeps_or_changes_the_priority():
    lru = filled()
    lru["b"] = 20  # keeps 5
    assert list(lru) == ["d", "b", "a", "e", "c"] and lru["b"] == 20
    lru.set("d", 4, -1)
    assert list(lru) == ["b", "a", "e", "c", "d"] and lru.priority("d") == -1
    lru["new"] = 7
    assert lru.priority("new") == 0 and list(lru) == ["b", "a", "e", "new", "c", "d"]


def test_weights_of_what_a_newcomer_may_evict():
    lru = filled()
    assert lru.weight_evicted_before(5) == 6
    assert lru.weight_evicted_before(1) == 6
    assert lru.weight_evicted_before(0) == 12
    assert lru.weight_evicted_before(-1) == 15
    assert lru.weight_evicted_before(6) == 0
    lru.pop("b")
    lru.pop("d")
    assert lru.weight_evicted_before(1) == 0 and lru.first() == "a"


def test_pop_get_and_an_emptied_priority():
    lru = filled()
    assert lru.get_priority("c") == lru.priority("c") and lru.get_priority("z") is None
    assert lru.pop("c") == 3 and "c" not in lru and lru.get("c") is None
    assert lru.get_priority("c") is None
    assert lru.pop("c", None) is None
    with pytest.raises(KeyError):
        lru.pop("c")
    assert lru.weight_evicted_before(-5) == 12 and len(lru) == 4
    lru.clear()
    assert not lru and lru.first() is None and list(lru) == []


def test_batched_set_and_discard_match_one_key_at_a_time():
    one, many = filled(), filled()
    for key, priority in [("a", 5), ("x", 0), ("c", -1), ("y", 7)]:
        one.set(key, 1, priority)
    many.set_many([("a", 5), ("x", 0), ("c", -1), ("y", 7)], 1)
    assert list(many) == list(one) and list(many.values()) == list(one.values())
    assert [many.priority(k) for k in many] == [one.priority(k) for k in one]
    for key in ("y", "b", "missing", "x"):
        one.pop(key, None)
    many.discard_many(["y", "b", "missing", "x"])
    assert list(many) == list(one) and len(many) == len(one)
    assert many.weight_evicted_before(-1) == one.weight_evicted_before(-1)
    many.discard_many(list(many))  # empties every level
    assert not many and many.first() is None and many.weight_evicted_before(-10) == 0


def test_removals_count_the_keys_that_left_and_not_an_update_of_one():
    lru = filled()
    lru["b"] = 20
    lru.set("d", 4, -1)
    lru.set_many([("a", 5), ("x", 0)], 1)
    lru.move_to_end("c")
    assert lru.removals == 0
    lru.pop("a")
    lru.pop("missing", None)
    lru.discard_many(["b", "missing", "c"])
    assert lru.removals == 3
    lru.clear()  # d, e, x
    assert lru.removals == 6
