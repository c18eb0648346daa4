"""The lineage map and unloads (proxy/lineages.py): pure logic, one folder, no processes.

- a name maps to itself until it starts a lineage, then to `NAME.G`; earlier lineages are
  served under no name, and `NAME.G` of a name with lineages is reserved;
- the map and unloads survive a restart (a new Lineages on the same folder); a damaged file
  is moved aside, never fatal;
- unloads are bounded per name and pruned to what the fleet holds (audit A16);
- peers' maps merge to one state whatever the order (generated interleavings on three
  proxies, clocks that jump back), a load that saw an unload wins over it, a generation never
  goes back, a new lineage is shared once released, and a hostile map changes nothing.
"""

from __future__ import annotations

import copy
import json
import random
import time

import pytest

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.proxy import lineages
from rollwire.proxy.lineages import Lineages


def test_a_new_lineage_takes_the_name_and_retires_the_old_one(tmp_path):
    book = Lineages(tmp_path)
    assert book.internal("trl-policy") == "trl-policy" and book.external("trl-policy") == "trl-policy"
    internal, generation = book.next_lineage("trl-policy", taken=lambda n: n == "trl-policy.2")
    assert (internal, generation) == ("trl-policy.3", 3)  # a name some replica has seen is skipped
    book.switch("trl-policy", generation)
    assert book.internal("trl-policy") == "trl-policy.3"
    assert book.external("trl-policy.3") == "trl-policy"
    assert book.external("trl-policy") is None and book.external("trl-policy.2") is None
    assert book.reserved("trl-policy.7") and not book.reserved("other.2")
    assert book.external("other.2") == "other.2"  # a name of its own, no lineage
    book.flush_now()
    assert Lineages(tmp_path).internal("trl-policy") == "trl-policy.3"  # durable


def test_unloads_are_durable_bounded_and_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr(lineages, "MAX_UNLOADED", 3)
    book = Lineages(tmp_path)
    book.unload("pol", [1, 2, 3, 4, 5])
    assert book.unloaded("pol") == {3, 4, 5}  # the oldest forgotten first
    book.show("pol", 4)
    book.flush_now()
    assert Lineages(tmp_path).unloaded("pol") == {3, 5}
    book.prune(lambda name, version: version == 5)  # the fleet holds v5 only
    book.flush_now()
    assert Lineages(tmp_path).unloaded("pol") == {5}
    book.prune(lambda name, version: False)
    book.flush_now()
    assert Lineages(tmp_path).unloaded("pol") == frozenset()


async def test_a_change_is_written_off_the_event_loop_one_write_at_a_time(tmp_path, monkeypatch):
    """flush writes on a worker thread (the loop keeps serving meanwhile), one write at a time,
    each of the state as it is when it starts: the file ends at the newest state, and a flush
    whose change a running write already covers writes nothing more."""
    import asyncio
    import threading

    book, loop_thread, writes = Lineages(tmp_path), threading.get_ident(), []
    gate = threading.Event()
    real = lineages.write_atomic

    def slow_write(path, data):
        writes.append((threading.get_ident(), json.loads(data)["marks"]))
        gate.wait(5)
        real(path, data)

    monkeypatch.setattr(lineages, "write_atomic", slow_write)
    book.unload("pol", [1])
    first = asyncio.ensure_future(book.flush())
    while not writes:
        await asyncio.sleep(0.001)  # the write is under way on its thread; this loop still runs
    book.unload("pol", [2])  # a change during the write: the next flush writes it
    second = asyncio.ensure_future(book.flush())
    third = asyncio.ensure_future(book.flush())
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, second, third), 10)
    assert all(thread != loop_thread for thread, _ in writes)
    assert [sorted(marks["pol"]) for _, marks in writes] == [["1"], ["1", "2"]]  # two writes, not three
    assert Lineages(tmp_path).unloaded("pol") == {1, 2}


def test_a_damaged_file_is_moved_aside(tmp_path):
    (tmp_path / lineages.FILE).write_text("{not json")
    book = Lineages(tmp_path)
    assert book.internal("x") == "x"
    assert [p.name.startswith(".lineages.json.damaged-") for p in tmp_path.iterdir()] == [True]


# -- peers: merges (proxy/lineages.py "Peer proxies share both") ------------------------------


class Clocks:
    """Each proxy's wall clock, set per step, so a clock that runs behind is a fact of the test."""

    def __init__(self, monkeypatch) -> None:
        self.now = 10**18
        monkeypatch.setattr(lineages.time, "time_ns", lambda: self.now)


def book_of(tmp_path, origin: str) -> Lineages:
    folder = tmp_path / origin
    folder.mkdir(exist_ok=True)
    return Lineages(folder, origin)


def send(sender: Lineages, receiver: Lineages) -> int:
    generations, marks = sender.shared()
    return receiver.merge(generations, marks, peer=sender.origin)


def state(book: Lineages):
    generations, marks = book.shared()
    return generations, marks, {n: book.unloaded(n) for n in marks}


def random_step(rng: random.Random, book: Lineages, books: list[Lineages], clocks: Clocks) -> None:
    clocks.now += rng.choice([-(10**9), 1, 10**6])  # clocks jump back, too (NTP steps)
    name = rng.choice(["pol", "trl-policy", "x"])
    internal = book.internal(name)
    op = rng.random()
    if op < 0.3:
        book.unload(internal, rng.sample(range(1, 7), rng.randint(1, 3)))
    elif op < 0.55:
        book.show(internal, rng.randint(1, 6))
    elif op < 0.65:
        generation = book._generation.get(name, 1) + rng.randint(1, 2)
        book.switch(name, generation)
    else:
        send(rng.choice([b for b in books if b is not book]), book)  # a partial sync


@pytest.mark.parametrize("seed", range(60))
def test_merges_converge_whatever_the_order(tmp_path, monkeypatch, seed):
    """Random interleavings of unloads, loads and new lineages on three proxies, with partial
    syncs between; then each proxy takes the others' maps, in two different orders: every
    proxy ends with the same generations, marks and unloaded versions, durable on disk."""
    monkeypatch.setattr(lineages, "MAX_UNLOADED", 4)  # the bound's trimming takes part, too
    rng, clocks = random.Random(seed), Clocks(monkeypatch)
    books = [book_of(tmp_path, o) for o in ("a", "b", "c")]
    for _ in range(rng.randint(5, 40)):
        random_step(rng, rng.choice(books), books, clocks)
    copies = []
    for book in books:
        twin = copy.deepcopy(book)
        twin.path = tmp_path / f"{book.origin}-twin" / lineages.FILE
        twin.path.parent.mkdir()
        copies.append(twin)
    a, b, c = books
    for sender, receiver in [(b, a), (c, a), (a, b), (a, c)]:
        send(sender, receiver)
    a2, b2, c2 = copies
    for sender, receiver in [(a2, c2), (b2, c2), (c2, a2), (c2, b2)]:
        send(sender, receiver)
    expected = state(a)
    assert all(state(x) == expected for x in (*books, *copies))
    a.flush_now()
    assert state(Lineages(a.path.parent, "a")) == expected  # as written
    assert all(send(x, y) == 0 for x in books for y in books if x is not y)  # nothing left to take


def test_a_load_after_seeing_an_unload_wins_even_with_a_clock_behind(tmp_path, monkeypatch):
    clocks = Clocks(monkeypatch)
    a, b = book_of(tmp_path, "a"), book_of(tmp_path, "b")
    a.unload("pol", [1, 2])
    send(a, b)
    clocks.now -= 3600 * 10**9  # b's clock is an hour behind a's
    assert b.show("pol", 1) is True
    assert send(b, a) == 1
    assert a.unloaded("pol") == b.unloaded("pol") == {2}  # the load came after the unload it saw
    b.unload("pol", [3])  # concurrent unloads of other versions on each: both hold
    a.unload("pol", [4])
    send(a, b)
    send(b, a)
    assert a.unloaded("pol") == b.unloaded("pol") == {2, 3, 4}
    assert b.show("pol", 9) is False
    b.flush_now()
    assert "9" not in json.loads(b.path.read_text())["marks"]["pol"]  # no mark: none


def test_a_peer_never_takes_a_generation_back_and_a_new_lineage_waits_for_release(tmp_path):
    a, b = book_of(tmp_path, "a"), book_of(tmp_path, "b")
    a.switch("trl-policy", 3)
    assert send(a, b) == 1 and b.internal("trl-policy") == "trl-policy.3"
    assert b.merge({"trl-policy": 2}, {}) == 0 and b.internal("trl-policy") == "trl-policy.3"
    a.switch("trl-policy", 4, shared=False)  # its v1 is not in the peers' spools yet
    assert a.internal("trl-policy") == "trl-policy.4" and a.shared()[0] == {"trl-policy": 3}
    revision = a.revision
    a.release("trl-policy", 4)
    assert a.revision > revision and a.shared()[0] == {"trl-policy": 4}
    a.switch("new", 2, shared=False)
    assert "new" not in a.shared()[0]  # generation 1 is no entry


def test_a_file_from_before_stamps_loads_and_merges(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / lineages.FILE).write_text(json.dumps({"lineages": {"pol": 2}, "unloaded": {"pol.2": [1, 3]}}))
    old = Lineages(folder, "old")
    assert old.internal("pol") == "pol.2" and old.unloaded("pol.2") == {1, 3}
    peer = book_of(tmp_path, "peer")
    send(old, peer)
    assert peer.unloaded("pol.2") == {1, 3}
    assert peer.show("pol.2", 3)  # any stamp beats the lowest one, an old file's
    send(peer, old)
    old.flush_now()
    assert old.unloaded("pol.2") == {1} and Lineages(folder).unloaded("pol.2") == {1}


def mark(at_ns: int = 1, by: str = "p", unloaded: bool = True) -> lineages.Mark:
    return lineages.Mark(at_ns, by, unloaded)


HOSTILE = {
    "a name that is a path": ({"../etc": 2}, {}),
    "an empty name": ({"": 2}, {}),
    "generation 1": ({"pol": 1}, {}),
    "generation 0": ({"pol": 0}, {}),
    "a generation too large": ({"pol": 10**12}, {}),
    "a generation that is no int": ({"pol": "2"}, {}),
    "an internal name too long": ({"a" * 64: 2}, {}),
    "too many names": ({f"n{i}": 2 for i in range(9)}, {}),
    "a mark of an invalid name": ({}, {"a/b": {1: mark()}}),
    "version 0": ({}, {"pol": {0: mark()}}),
    "a negative version": ({}, {"pol": {-3: mark()}}),
    "too many marks of a name": ({}, {"pol": {v: mark() for v in range(1, 6)}}),
    "marks of too many names": ({}, {f"n{i}": {1: mark()} for i in range(9)}),
    "a stamp a year ahead": ({}, {"pol": {1: mark(at_ns=time.time_ns() + 365 * 86400 * 10**9)}}),
    "a negative stamp": ({}, {"pol": {1: mark(at_ns=-1)}}),
    "a proxy id too long": ({}, {"pol": {1: mark(by="p" * 300)}}),
    "a proxy id with a newline": ({}, {"pol": {1: mark(by="p\nq")}}),
}


@pytest.mark.parametrize("payload", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_map_is_refused_and_changes_nothing(tmp_path, monkeypatch, payload):
    monkeypatch.setattr(lineages, "MAX_NAMES", 8)
    monkeypatch.setattr(lineages, "MAX_UNLOADED", 4)
    book = book_of(tmp_path, "a")
    book.switch("pol", 2)
    book.unload("pol.2", [1])
    book.flush_now()
    before, on_disk = state(book), book.path.read_bytes()
    with pytest.raises(InvalidArgument) as err:
        book.merge(*payload, peer="evil")
    assert err.value.reason == Reason.BAD_LINEAGES and err.value.message
    book.flush_now()
    assert state(book) == before and book.path.read_bytes() == on_disk


def test_a_map_that_would_overflow_the_bounds_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(lineages, "MAX_NAMES", 3)
    book = book_of(tmp_path, "a")
    for name in ("x", "y"):
        book.switch(name, 2)
    with pytest.raises(ResourceExhausted):
        book.merge({"p": 2, "q": 2}, {})
    assert book.shared()[0] == {"x": 2, "y": 2}
    assert book.merge({"p": 2, "x": 5}, {}) == 2  # up to the bound it is taken
    monkeypatch.setattr(lineages, "MAX_MARKS", 4)
    book.unload("x.5", [1, 2, 3])
    with pytest.raises(ResourceExhausted):
        book.unload("y.2", [1, 2])
    with pytest.raises(ResourceExhausted):
        book.merge({}, {"p.2": {1: mark(), 2: mark()}})
    assert book.unloaded("x.5") == {1, 2, 3} and not book.unloaded("y.2") and not book.unloaded("p.2")
    book.unload("x.5", [3])  # marks it holds already: nothing more kept
    assert book.merge({}, {"x.5": {1: mark(at_ns=time.time_ns() + 10**9, unloaded=False)}}) == 1
