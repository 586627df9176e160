"""The remote tier against a server it cannot trust (a fake one, tests/hostile_server.py):
replies of the wrong type, malformed RESP, records of other keys or damaged, replies
dripped, cut off, short or long by one, redirections nowhere, slot maps, SCAN pages and
INFO that are garbage. Whatever the server does, every call of the store raises nothing,
returns within its deadline, serves a record only if it is the one put under that key,
holds no more memory than the bytes that arrived, and the store serves again once the
server behaves."""
from __future__ import annotations

import dataclasses
import itertools
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from valkey.crc import key_slot

from engine import LLM
from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from hostile_server import HostileServer, Reply, array, bulk
from memory_testing import traced_peak
from remote_testing import ANSWER_S, SECRET, SILENT_S, watch_network
from storage import call_deadline, remote_store
from storage.base import BlockKey
from storage.record import encode_record
from storage.remote_store import BreakerConfig, RemoteStore
from test_remote_store import KEY, key, record
from tier_testing import BLOCK, FLUSH, GREEDY, PROMPTS, hit_tokens, make_llm
from tiered_kv import TierConfig

TIMEOUT_S = 0.2  # the calls that meet a silent server wait this long
SLACK_S = 2.0  # a loaded machine's pauses
COOLDOWN_S = 1.0
N = 3
KEYS = [key(i) for i in range(N)]
RECORDS = [record(i) for i in range(N)]
SEALED = [encode_record(r, KEY) for r in RECORDS]
TIB = 1 << 40
MODES = ("server", "resp3", "cluster")

FUZZ = settings(
    max_examples=10, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def url(server: HostileServer, mode: str) -> str:
    return server.url + ("?protocol=3" if mode == "resp3" else "")


def store(url: str, failures: int = 1000) -> RemoteStore:
    """A store whose breaker (by default) stays closed, so every call meets the server."""
    return RemoteStore(url, seal_key=KEY, prefix="tkv:", timeout_s=TIMEOUT_S, stats_interval_s=0,
                       breaker=BreakerConfig(failures=failures, cooldown_s=COOLDOWN_S))


# ---------------------------------------------------------------- what a reply may become


def _value(server: HostileServer, command: list[bytes]) -> bytes:
    """The record the server holds under the command's key, or any other one."""
    name = command[1] if len(command) > 1 else b""
    return server.data.get(name) or next(iter(server.data.values()), SEALED[0])


def _other_record(server: HostileServer, command: list[bytes]) -> bytes:
    """A genuine record, sealed with the deployment's key, of another key."""
    mine = server.data.get(command[1]) if len(command) > 1 else None
    return bulk(next((v for v in SEALED if v != mine), SEALED[0]))


def _flipped(server: HostileServer, command: list[bytes], at: int) -> bytes:
    value = bytearray(_value(server, command))
    value[at % len(value)] ^= 1 << (at % 8)
    return bulk(bytes(value))


def _truncated(server: HostileServer, command: list[bytes], at: int) -> bytes:
    value = _value(server, command)
    return bulk(value[: at % len(value)])


RESP3_TYPES = (b"#t\r\n", b",1.5\r\n", b"_\r\n", b"(12345678901234567890\r\n",
               b"%1\r\n+a\r\n:1\r\n", b"~1\r\n:1\r\n", b"=7\r\ntxt:abc\r\n")
_NODE = array([bulk(b"127.0.0.1"), b":1\r\n", bulk(b"0" * 40)])  # a port nothing listens on

# Each: (server, command, a drawn number) -> what the command gets instead of its reply.
MUTATIONS = {
    "honest": lambda s, c, n: s.honest(c),
    "nil": lambda s, c, n: b"$-1\r\n",
    "integer": lambda s, c, n: b":%d\r\n" % (n - 500_000),
    "array": lambda s, c, n: array([bulk(b"a"), b":1\r\n", array([])]),
    "error": lambda s, c, n: b"-ERR not today\r\n",
    "status": lambda s, c, n: b"+OK\r\n",
    "resp3 types": lambda s, c, n: RESP3_TYPES[n % len(RESP3_TYPES)],
    "bad prefix": lambda s, c, n: b"?what\r\n",
    "bad length": lambda s, c, n: b"$1x\r\nabc\r\n",
    "negative length": lambda s, c, n: b"$-%d\r\nabcdef\r\n" % (2 + n % 100),
    "huge array": lambda s, c, n: b"*%d\r\n:1\r\n" % TIB,
    "other record": lambda s, c, n: _other_record(s, c),
    "flipped byte": _flipped,
    "truncated": _truncated,
    "moved": lambda s, c, n: b"-MOVED %d 127.0.0.1:1\r\n" % (n % 16384),
    "moved nowhere": lambda s, c, n: b"-MOVED 12 nonsense\r\n",
    "ask": lambda s, c, n: b"-ASK %d 127.0.0.1:%d\r\n" % (n % 16384, s.port),
    "scan garbage": lambda s, c, n: array([bulk(b"%d" % n),
                                           array([b":7\r\n", array([]), bulk(b"tkv:zz")])]),
    "scan not a page": lambda s, c, n: array([bulk(b"x")]),
    "info garbage": lambda s, c, n: bulk(b"used_memory:inf\r\nmaxmemory:-%d\r\n\x00\xff" % n),
    "slot map elsewhere": lambda s, c, n: array([array([b":0\r\n", b":16383\r\n", _NODE])]),
    "slot map too big": lambda s, c, n: array([array([b":0\r\n", b":%d\r\n" % (2 << 20), _NODE])]),
    "slot map garbage": lambda s, c, n: array([array([bulk(b"x"), b":1\r\n"])]),
}
# How a batch's replies end: all of them, one short (then silence), one extra, one extra
# before them (every reply after it shifted to the next command), cut off at a byte and the
# connection closed, dripped slower than the deadline, or a bulk reply that declares a
# terabyte and sends three bytes before silence or closing.
ENDINGS = ("all", "short", "extra", "extra first", "cut", "drip", "terabyte, silent",
           "terabyte, closed")


def reply_for(server: HostileServer, batch: list[list[bytes]], ending: str,
              mutations: list[str], n: int) -> Reply:
    replies = [MUTATIONS[mutations[i % len(mutations)]](server, c, n + i)
               for i, c in enumerate(batch)]
    data = b"".join(replies)
    if ending == "short":
        return Reply(b"".join(replies[:-1]), then="hang")
    if ending == "extra":
        return Reply(data + server.honest(batch[0]))
    if ending == "extra first":
        return Reply(server.honest(batch[0]) + data)
    if ending == "cut":
        return Reply(data[: n % max(len(data), 1)], then="close")
    if ending == "drip":
        return Reply(data, drip_s=TIMEOUT_S / 4, then="close")
    if ending.startswith("terabyte"):
        return Reply(b"".join(replies[:-1]) + b"$%d\r\nabc" % TIB,
                     then="hang" if ending.endswith("silent") else "close")
    return Reply(data)


plans = st.lists(
    st.tuples(st.sampled_from(ENDINGS), st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1,
                                                 max_size=3),
              st.integers(0, 1 << 20)),
    min_size=1, max_size=4,
)


def play(server: HostileServer, plan: list[tuple[str, list[str], int]]) -> None:
    """Answer the i-th batch of data commands by ``plan[i]``, round and round."""
    turns = itertools.cycle(plan)
    server.script = lambda batch: reply_for(server, batch, *next(turns))


# ---------------------------------------------------------------- the properties


def timed(call, calls: int = 1):
    """``call()``, which must return within ``calls`` deadlines."""
    start = time.monotonic()
    result = call()
    took = time.monotonic() - start
    assert took < calls * TIMEOUT_S + SLACK_S, f"took {took:.2f} s"
    return result


def check_served(records: list) -> None:
    """Each is a miss or exactly the record put under its key."""
    for i, r in enumerate(records):
        assert r is None or encode_record(r, KEY) == SEALED[i], f"key {i}: another record served"


def exercise(s: RemoteStore) -> None:
    """Every public method of the store, against whatever the server does now: no
    exception, no call past its deadlines, no wrong record."""
    timed(lambda: s.put_many(list(zip(KEYS, RECORDS))))
    # a get, a get again of what failed its checks on a new connection, a delete of what is corrupt
    check_served(timed(lambda: s.get_many(KEYS), calls=3))
    check_served([timed(lambda: s.get(KEYS[0]), calls=3)])
    assert len(timed(lambda: s.contains_many(KEYS))) == N
    assert 0 <= timed(lambda: s.longest_prefix(KEYS)) <= N
    assert all(isinstance(k, BlockKey) for k in timed(lambda: list(s.keys()), calls=3))
    timed(lambda: s.stats(), calls=4)
    assert 0 <= timed(lambda: s.delete_many(KEYS[:1])) <= 1
    timed(lambda: s.available)


def recovers(s: RemoteStore, server: HostileServer, clock) -> None:
    """Once the server behaves, the store serves again after at most a cooldown (a
    few tries: on a loaded machine an honest reply can miss the deadline)."""
    server.script = None
    for _ in range(5):
        clock.now += COOLDOWN_S
        if s.put(KEYS[0], RECORDS[0]) and (got := s.get(KEYS[0])) is not None:
            assert encode_record(got, KEY) == SEALED[0]
            return
    pytest.fail("the store did not serve again once the server behaved")


def play_and_recover(mode: str, plan, clock) -> None:
    """An honest start (records to serve, or not), then ``plan`` played against every
    public method of the store, then the server behaves and the store must serve again."""
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    try:
        s.put_many(list(zip(KEYS, RECORDS)))
        play(server, plan)
        exercise(s)
        recovers(s, server, clock)
    finally:
        s.close()
        server.stop()


@pytest.fixture
def scan_pages(monkeypatch):
    """A walk of keys ends after this many pages, not a few hundred thousand."""
    monkeypatch.setattr(remote_store, "_MAX_SCAN_PAGES", 64)


@pytest.mark.parametrize("mode", MODES)
@FUZZ
@given(plan=plans)
def test_fuzzed_replies_are_misses_and_drops_never_errors_or_wrong_records(
    mode, plan, breaker_clock, scan_pages
):
    play_and_recover(mode, plan, breaker_clock)


# Each mutation once and each ending once, whatever the fuzz draws.
CASES = [(f"{m}", MODES[i % 3], [("all", [m], 12345)]) for i, m in enumerate(sorted(MUTATIONS))] + [
    (f"{e}", MODES[i % 3], [(e, ["honest"], 777)]) for i, e in enumerate(ENDINGS)
]


@pytest.mark.parametrize(("case", "mode", "plan"), CASES, ids=[c[0] for c in CASES])
def test_each_hostile_reply(case, mode, plan, breaker_clock, scan_pages):
    play_and_recover(mode, plan, breaker_clock)


@pytest.mark.parametrize("mode", MODES)
def test_the_breaker_opens_on_a_silent_server_and_closes_once_it_behaves(mode, breaker_clock):
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode), failures=1)
    try:
        assert s.put(KEYS[0], RECORDS[0])
        server.script = lambda batch: Reply(then="hang")
        assert timed(lambda: s.get(KEYS[0])) is None
        assert not s.available
        recovers(s, server, breaker_clock)
        assert s.available
    finally:
        s.close()
        server.stop()


# ---------------------------------------------------------------- what the fuzz found


def test_a_delete_answered_with_garbage_deleted_nothing():
    """A corrupt record is deleted; a reply to ``DEL`` that is not an integer is no
    deletion (it was a ``ValueError`` out of ``get``)."""
    server = HostileServer()
    s = store(server.url)
    try:
        server.script = lambda batch: Reply(b"".join(
            bulk(b"not a record") if c[0] == b"GET" else b"$3\r\nabc\r\n" for c in batch
        ))
        assert s.get(KEYS[0]) is None and s.stats().corrupt == 1
        assert s.delete_many(KEYS) == 0
        server.script = lambda batch: Reply(b"$-1\r\n" * len(batch))
        assert s.delete_many(KEYS) == 0
    finally:
        s.close()
        server.stop()


def test_a_scan_page_of_garbage_is_no_keys():
    """Keys that are not strings, and pages that are not pages, end the walk (they were a
    ``TypeError`` out of ``keys``)."""
    server = HostileServer()
    s = store(server.url)
    try:
        for page in (array([bulk(b"0"), array([b":5\r\n", array([bulk(b"x")])])]),
                     array([bulk(b"0"), b":5\r\n"]), array([bulk(b"0"), bulk(b"tkv:ab")])):
            server.script = lambda batch, page=page: Reply(page)
            assert list(s.keys()) == []
    finally:
        s.close()
        server.stop()


def test_a_scan_whose_cursor_never_ends_stops(scan_pages):
    """A server that hands out a new cursor on every page (never one already passed) kept
    the walk going, and ``stats()`` with it, as long as the server liked."""
    server = HostileServer()
    s = store(server.url)
    pages = itertools.count(1)

    def endless(batch):
        page = next(pages)
        if page > 1000:  # end here what the walk would not
            return Reply(array([bulk(b"0"), array([])]))
        return Reply(array([bulk(b"%d" % page), array([])]))

    try:
        server.script = endless
        assert list(s.keys()) == []
        assert next(pages) == 65  # 64 pages, then this call
    finally:
        s.close()
        server.stop()


def get_in_little_memory(s: RemoteStore):
    """``s.get`` of a key, in its deadline and with at most 32 MiB allocated at its peak."""
    got, peak = traced_peak(lambda: timed(lambda: s.get(KEYS[0])))
    assert peak < 32 << 20, f"{peak >> 20} MiB"
    return got


@pytest.mark.parametrize("mode", MODES)
def test_a_reply_declaring_a_terabyte_allocates_nothing_of_it(mode):
    """A bulk reply that declares 1 TiB and streams junk as fast as it is read: each byte
    bought the call more time than it took to arrive, so the call lasted as long as the
    server liked, holding every byte (gigabytes in seconds)."""
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    flood = Reply(b"$%d\r\n" % TIB, then="flood", flood_bytes=256 << 20)
    server.script = lambda batch: flood
    try:
        assert get_in_little_memory(s) is None
    finally:
        s.close()
        server.stop()


def test_a_slot_map_of_millions_of_slots_is_refused():
    """The client library makes an entry for every slot a ``CLUSTER SLOTS`` range names:
    a range of 2 million took seconds and hundreds of MiB (of 10**11, minutes and all the
    memory there is)."""
    server = HostileServer(cluster=True)
    s = store(server.url)
    too_big = MUTATIONS["slot map too big"](server, [b"CLUSTER", b"SLOTS"], 0)
    server.script = lambda batch: Reply(too_big) if batch[0][0] == b"CLUSTER" else None
    try:
        assert get_in_little_memory(s) is None
    finally:
        s.close()
        server.stop()


def test_a_slot_map_naming_a_node_that_never_answers_does_not_keep_the_breaker_open(
    breaker_clock,
):
    """A slot map that put every slot on a node that takes connections and never answers:
    each probe asked that node first, for the slot map, and spent its deadline there, so
    the breaker never closed although the URL's node answered again."""
    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen(64)  # connections complete in the backlog; nothing reads them
    node = array([bulk(b"127.0.0.1"), b":%d\r\n" % tarpit.getsockname()[1], bulk(b"1" * 40)])
    server = HostileServer(cluster=True)
    s = store(server.url, failures=1)
    slot_map = array([array([b":0\r\n", b":16383\r\n", node])])
    try:
        server.script = lambda batch: Reply(slot_map) if batch[0][0] == b"CLUSTER" else None
        assert timed(lambda: s.get(KEYS[0])) is None
        assert not s.available
        recovers(s, server, breaker_clock)
    finally:
        s.close()
        server.stop()
        tarpit.close()


@pytest.mark.parametrize("mode", MODES)
def test_memory_figures_out_of_range_are_not_reported(mode):
    """``stats()`` passed on a ``used_memory`` of 400 digits, past a float's range: every
    scrape of the metrics failed on it."""
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    try:
        for info in (b"used_memory:" + b"9" * 400, b"used_memory:1\r\nmaxmemory:-5"):
            server.script = lambda batch, info=info: (
                Reply(bulk(info)) if batch[0][0] == b"INFO" else None
            )
            st = s.stats()
            assert 0 <= st.bytes_used < 1 << 64 and 0 <= st.capacity_bytes < 1 << 64
    finally:
        s.close()
        server.stop()


# ---------------------------------------------------------------- behind the tier manager


@pytest.fixture(scope="module")
def reference() -> list[int]:
    with LLM(max_model_len=256, enable_prefix_caching=False, device="cpu") as llm:
        return llm.generate(PROMPTS[0], GREEDY)[0].token_ids


def swapped(server: HostileServer, saved: dict[bytes, bytes]):
    """Each ``GET`` answered with the genuine record of another key, the rest honestly."""
    values = list(saved.values())

    def script(batch):
        return Reply(b"".join(
            bulk(values[(values.index(saved[c[1]]) + 1) % len(values)])
            if c[0] == b"GET" and c[1] in saved else server.honest(c) for c in batch
        ))
    return script


def test_an_engine_recomputes_whatever_a_hostile_server_serves(reference, breaker_clock):
    """Blocks an engine stored on a server that then serves other keys' genuine records,
    damaged ones, the wrong types, or drips: another engine computes the same tokens with
    no remote hit, and hits again once the server behaves."""
    server = HostileServer()
    writer = TierConfig(remote_url=server.url, remote_prefix="tkv:", remote_secret=SECRET,
                        cpu_bytes=0, remote_timeout_s=ANSWER_S)
    reader = dataclasses.replace(writer, remote_write_policy="read-only",
                                 remote_timeout_s=SILENT_S)

    def cached_tokens(llm) -> int:
        out = llm.generate(PROMPTS[0], GREEDY)[0]
        assert out.token_ids == reference
        llm.generate(FLUSH, GREEDY)  # so that the engine's own cache cannot serve it next
        return out.num_cached_tokens

    try:
        with make_llm(writer) as a:
            a.generate(PROMPTS[0], GREEDY)
            assert a.engine.connector.flush(30)
        saved = dict(server.data)
        assert len(saved) >= hit_tokens(PROMPTS[0]) // BLOCK
        hostile = {
            "another key's record": swapped(server, saved),
            "a flipped byte": lambda batch: Reply(b"".join(
                _flipped(server, c, 999) if c[0] == b"GET" else server.honest(c) for c in batch
            )),
            "wrong types": lambda batch: Reply(b":1\r\n" * len(batch)),
            "a drip": lambda batch: Reply(b"".join(server.honest(c) for c in batch),
                                          drip_s=SILENT_S / 4, then="close"),
        }
        with make_llm(reader) as b:
            assert cached_tokens(b) == hit_tokens(PROMPTS[0])
            for name, script in hostile.items():
                server.script = script
                assert cached_tokens(b) == 0, name
                server.data = dict(saved)  # what the reader deleted as corrupt
            server.script = None
            breaker_clock.now += BreakerConfig().cooldown_s
            assert cached_tokens(b) == hit_tokens(PROMPTS[0])
            stats = b.engine.connector.stats()["remote"]
        assert stats["corrupt"] >= 2 and stats["hit_blocks"] == 2 * hit_tokens(PROMPTS[0]) // BLOCK
    finally:
        server.stop()


# ---------------------------------------------------------------- a connection out of step


def kbs(keys) -> list[bytes]:
    return [b"tkv:" + k.namespace.hex().encode() + b":" + k.block_hash.hex().encode()
            for k in keys]


def served_and_kept(s: RemoteStore, server: HostileServer, got: list) -> None:
    """``got`` is every record, as put; none was deleted or counted corrupt, and the next
    get serves them all again."""
    check_served(got)
    assert None not in got
    assert all(kb in server.data for kb in kbs(KEYS)), "a good record was deleted"
    assert s.stats().corrupt == 0
    check_served(again := s.get_many(KEYS))
    assert None not in again


STRAYS = {
    "another get's record": bulk(SEALED[-1]),
    "a set's OK": b"+OK\r\n",
    "a get's nil": b"$-1\r\n",
}
RESP3_NIL = b"_\r\n"  # a nil in RESP3, where ``$-1`` is a protocol error


@pytest.mark.parametrize("stray", sorted(STRAYS))
@pytest.mark.parametrize("mode", MODES)
def test_a_stray_reply_before_a_pipelined_get_deletes_no_good_record(mode, stray):
    """A server (or a proxy) that sends one reply too many, just before the replies of a
    pipelined get: every reply after it was its command's neighbour's, each good record
    failed verification as another key's (or damaged) and was deleted."""
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    strays = [RESP3_NIL if (mode, stray) == ("resp3", "a get's nil") else STRAYS[stray]]

    def script(batch):
        if batch[0][0] != b"GET" or not strays:
            return None
        return Reply(strays.pop() + b"".join(server.honest(c) for c in batch))

    try:
        assert all(s.put_many(list(zip(KEYS, RECORDS))))
        server.script = script
        served_and_kept(s, server, timed(lambda: s.get_many(KEYS), calls=3))
    finally:
        s.close()
        server.stop()


@pytest.mark.parametrize("mode", MODES)
def test_a_late_reply_after_a_timeout_deletes_no_good_record(mode, breaker_clock):
    """A proxy that answers a get the client gave up on (its deadline passed) on the next
    connection, before the next get's replies: the first key got its own record, each key
    after it the record of the key before, failed verification and was deleted."""
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    gets = itertools.count()
    withheld: list[bytes] = []  # the replies to the get given up on

    def script(batch):
        if batch[0][0] != b"GET":
            return None
        honest = b"".join(server.honest(c) for c in batch)
        turn = next(gets)
        if turn == 0:
            withheld.append(honest)
            return Reply(then="hang")
        return Reply(withheld.pop() + honest) if turn == 1 else None

    try:
        assert all(s.put_many(list(zip(KEYS, RECORDS))))
        server.script = script
        assert timed(lambda: s.get(KEYS[0])) is None
        breaker_clock.now += COOLDOWN_S  # a cluster's node that did not answer is down
        served_and_kept(s, server, timed(lambda: s.get_many(KEYS), calls=3))
    finally:
        s.close()
        server.stop()


def test_a_cluster_node_replying_outside_the_protocol_costs_only_its_keys(breaker_clock):
    """A node whose reply the parser refuses: the client read on past it, failed the whole
    call (every node of it taken for down), and pooled the other nodes' connections with
    their replies still to come. That node's keys are misses now, the others are served,
    and their connections stay in step."""
    bad, good = HostileServer(cluster=True), HostileServer(cluster=True)
    keys = [key(i) for i in range(8)]
    records = [record(i) for i in range(8)]
    split = sorted(key_slot(kb) for kb in kbs(keys))[3]  # four keys on each node
    bad.slot_owners = good.slot_owners = [(0, split, bad.port), (split + 1, 16383, good.port)]
    on_good = [key_slot(kb) > split for kb in kbs(keys)]

    def slow(batch):  # its replies come after the bad node's
        if batch[0][0] == b"GET":
            time.sleep(TIMEOUT_S / 4)

    s = store(bad.url)
    try:
        assert all(s.put_many(list(zip(keys, records))))
        bad.script = lambda batch: Reply(b"?what\r\n") if batch[0][0] == b"GET" else None
        good.script = slow
        got = timed(lambda: s.get_many(keys), calls=3)
        assert [r is not None for r in got] == on_good
        bad.script = good.script = None
        breaker_clock.now += COOLDOWN_S
        got += timed(lambda: s.get_many(keys), calls=3)
        sealed = [encode_record(r, KEY) for r in records]
        assert all(r is None or encode_record(r, KEY) == sealed[i % 8] for i, r in enumerate(got))
        assert None not in got[8:] and s.stats().corrupt == 0
    finally:
        s.close()
        bad.stop()
        good.stop()


# ---------------------------------------------------------------- the bytes of a call


@pytest.fixture
def small_calls(monkeypatch):
    """A bulk reply of at most 256 KiB, and a call of at most 320 KiB: a batch of the
    longest replies is then megabytes, not gigabytes."""
    monkeypatch.setattr(call_deadline, "MAX_BULK_BYTES", 256 << 10)
    monkeypatch.setattr(call_deadline, "MAX_CALL_BYTES", 320 << 10)


@pytest.mark.parametrize("mode", MODES)
def test_a_pipeline_of_the_longest_replies_holds_one_calls_bytes(mode, small_calls):
    """Each of a batch's gets answered with a bulk reply as long as one may be: a call
    held them all, the batch's length times the longest bulk reply (32 GiB for a load of
    32 blocks)."""
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    keys = [key(i) for i in range(32)]
    longest = bulk(b"x" * (256 << 10))
    server.script = lambda batch: (
        Reply(longest, times=len(batch)) if batch[0][0] == b"GET" else None
    )
    try:
        assert s.put(KEYS[0], RECORDS[0])
        got, peak = traced_peak(lambda: timed(lambda: s.get_many(keys), calls=3))
        assert got == [None] * len(keys)
        assert peak < 3 << 20, f"{peak >> 10} KiB"  # 32 replies: 8 MiB
    finally:
        s.close()
        server.stop()


@pytest.mark.parametrize("mode", MODES)
def test_records_larger_together_than_a_call_are_read_in_several(mode, monkeypatch):
    """A batch whose records pass a call's bytes is read in as many calls as it takes,
    every record served."""
    monkeypatch.setattr(call_deadline, "MAX_BULK_BYTES", 1024)
    monkeypatch.setattr(call_deadline, "MAX_CALL_BYTES", 2048)  # about 6 records of 311 bytes
    server = HostileServer(cluster=mode == "cluster")
    s = store(url(server, mode))
    keys = [key(i) for i in range(32)]
    records = [record(i) for i in range(32)]
    try:
        assert all(s.put_many(list(zip(keys, records))))
        calls = watch_network(monkeypatch, s)
        got = timed(lambda: s.get_many(keys), calls=len(keys))
        assert [encode_record(r, KEY) for r in got] == [encode_record(r, KEY) for r in records]
        assert 4 <= calls.count("pipeline") <= len(keys) // 2
        assert s.stats().corrupt == 0 and len(server.data) == len(keys)
    finally:
        s.close()
        server.stop()


# ---------------------------------------------------------------- a node's INFO


INFO_GARBAGE = {
    "figures that are not numbers": bulk(b"used_memory:inf\r\nmaxmemory:-7\r\n\x00\xff"),
    "figures out of range": bulk(b"used_memory:" + b"9" * 400),
    "an error": b"-ERR not today\r\n",
    "an integer": b":7\r\n",
}


@pytest.mark.parametrize("garbage", sorted(INFO_GARBAGE))
def test_a_cluster_node_answering_info_with_garbage_costs_only_its_figures(garbage, caplog):
    """One node of a cluster answers ``INFO memory`` with garbage: the whole refresh
    failed, and the metrics lost every node's figures. Its own are left out, once per
    refresh, and a WARNING says so once in a while."""
    bad, good = HostileServer(cluster=True), HostileServer(cluster=True)
    bad.slot_owners = good.slot_owners = [(0, 8191, bad.port), (8192, 16383, good.port)]
    bad.script = lambda batch: Reply(INFO_GARBAGE[garbage]) if batch[0][0] == b"INFO" else None
    figures = bulk(b"# Memory\r\nused_memory:1000\r\nmaxmemory:5000\r\n")
    good.script = lambda batch: Reply(figures) if batch[0][0] == b"INFO" else None
    s = store(bad.url)
    try:
        assert all(s.put_many(list(zip(KEYS, RECORDS))))
        for _ in range(3):
            st = s.stats()
            assert (st.bytes_used, st.capacity_bytes, st.entries) == (1000, 5000, N)
        warnings = [r.getMessage() for r in caplog.records if "no figures" in r.getMessage()]
        assert len(warnings) == 1 and f"127.0.0.1:{bad.port}" in warnings[0], warnings
    finally:
        s.close()
        bad.stop()
        good.stop()
