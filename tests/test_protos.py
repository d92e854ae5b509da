"""The checked-in generated protobuf modules match protos/*.proto."""

from peer.proto import build


def test_generated_code_is_fresh(tmp_path):
    for generated in build.generate(tmp_path):
        checked_in = build.OUT_DIR / generated.name
        assert checked_in.exists(), f"{checked_in.name} missing: run `make protos`"
        assert generated.read_text() == checked_in.read_text(), f"{checked_in.name} is stale: run `make protos`"


def test_every_proto_field_is_commented():
    for proto in build.PROTO_DIR.glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "option")):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
