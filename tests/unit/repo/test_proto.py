"""The committed stubs are exactly what `make proto` generates from proto/."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[3]


def test_stubs_match_protos(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
    ]
    assert protoc.main(args + protos) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / "client" / rel
        assert committed.exists(), f"{committed} is missing: run `make proto` and commit"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{committed} drifted from proto/: run `make proto`"
        )


def test_every_enum_zero_value_is_unspecified():
    from rollwire.v1 import admin_pb2, generator_pb2, learner_pb2

    for module in (generator_pb2, admin_pb2, learner_pb2):
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED"), enum.name
