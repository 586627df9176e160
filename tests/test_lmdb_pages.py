from __future__ import annotations

from storage.lmdb_pages import Leak, PageOwners


def test_each_page_is_claimed_once_and_its_owner_named():
    owners = PageOwners(20)
    owners.claim_tree("records", 2)
    assert owners.claim_run("records", 3, 4) is None  # pages 3..6
    assert owners.claim_free([8, 7]) is None
    assert owners.claim_run("meta", 9, 1) is None
    assert [owners.owner(page) for page in (2, 3, 5, 7, 9, 10)] == [
        "the records db's tree",
        "the records db's overflow run at page 3",
        "the records db's overflow run at page 3",
        "the free list",
        "the meta db's overflow run at page 9",
        None,
    ]
    assert [owners.is_tree(page) for page in (2, 3, 7, 10)] == [True, False, False, False]


def test_a_run_keeps_only_the_pages_before_another_owners():
    owners = PageOwners(20)
    assert owners.claim_run("records", 6, 3) is None  # pages 6..8
    assert owners.claim_run("records", 2, 10) == 6  # pages 2..5, then run 6's
    assert owners.claim_run("records", 9, 2) is None  # not run 2's: it stopped at 6
    assert owners.owner(5) == "the records db's overflow run at page 2"
    assert owners.owner(8) == "the records db's overflow run at page 6"
    assert owners.claim_run("records", 2, 1) == 2  # two values on one run
    assert owners.claim_free([12, 3, 13, 10]) == 3  # the others are still claimed
    assert owners.owner(13) == "the free list"


def test_pages_past_the_end_of_the_file_are_never_claimed():
    owners = PageOwners(10)
    assert owners.claim_run("records", 8, 5) is None  # pages 10.. are not in the file
    assert owners.claim_free([11, 12]) is None
    owners.claim_tree("records", 15)
    assert owners.owner(9) == "the records db's overflow run at page 8"
    assert owners.owner(12) is None and not owners.is_tree(15)


def test_dbs_past_the_63rd_share_a_number_and_are_named_as_such():
    owners = PageOwners(100)
    for i in range(70):
        owners.claim_tree(f"db{i}", 2 + i)
    assert owners.owner(2 + 61) == "the db61 db's tree"
    assert owners.owner(2 + 69) == "the 63rd or later db's tree"


def test_pages_nothing_claims_are_counted_and_the_first_named():
    owners = PageOwners(20)
    owners.claim_tree("records", 2)
    assert owners.claim_run("records", 3, 4) is None  # pages 3..6
    assert owners.claim_free([8, 10]) is None
    assert owners.claim_run("meta", 11, 8) is None  # pages 11..18
    assert owners.unclaimed(2) == Leak(3, (7, 9, 19))
    assert owners.unclaimed(8) == Leak(2, (9, 19))
    leak = owners.unclaimed(2, shown=2)
    assert leak == Leak(3, (7, 9)) and leak.listed() == "7, 9, ..."
    owners.claim_free([7, 9, 19])
    assert owners.unclaimed(2) == Leak(0, ()) and owners.unclaimed(0) == Leak(2, (0, 1))
