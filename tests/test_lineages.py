"""The lineage map and unloads (proxy/lineages.py): pure logic, one folder, no processes.

- a name maps to itself until it starts a lineage, then to `NAME.G`; earlier lineages are
  served under no name, and `NAME.G` of a name with lineages is reserved;
- the map and unloads survive a restart (a new Lineages on the same folder); a damaged file
  is moved aside, never fatal;
- unloads are bounded per name and pruned to what the fleet holds (audit A16).
"""

from __future__ import annotations

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
    assert Lineages(tmp_path).internal("trl-policy") == "trl-policy.3"  # durable


def test_unloads_are_durable_bounded_and_pruned(tmp_path, monkeypatch):
    monkeypatch.setattr(lineages, "MAX_UNLOADED", 3)
    book = Lineages(tmp_path)
    book.unload("pol", [1, 2, 3, 4, 5])
    assert book.unloaded("pol") == {3, 4, 5}  # the oldest forgotten first
    book.show("pol", 4)
    assert Lineages(tmp_path).unloaded("pol") == {3, 5}
    book.prune(lambda name, version: version == 5)  # the fleet holds v5 only
    assert Lineages(tmp_path).unloaded("pol") == {5}
    book.prune(lambda name, version: False)
    assert Lineages(tmp_path).unloaded("pol") == frozenset()


def test_a_damaged_file_is_moved_aside(tmp_path):
    (tmp_path / lineages.FILE).write_text("{not json")
    book = Lineages(tmp_path)
    assert book.internal("x") == "x"
    assert [p.name.startswith(".lineages.json.damaged-") for p in tmp_path.iterdir()] == [True]
