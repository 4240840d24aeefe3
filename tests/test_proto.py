"""The committed gRPC stubs are exactly what the pinned generator makes from proto/."""

from pathlib import Path

from tulip.protogen import ROOT, generate


def test_committed_stubs_are_fresh(tmp_path):
    for built in generate(tmp_path):
        committed = ROOT / built.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} missing: run `make proto` and commit"
        assert committed.read_bytes() == built.read_bytes(), f"{committed} is stale: run `make proto` and commit"


def test_stubs_import_and_roundtrip():
    from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc

    req = tulip_pb2.EmbedRequest(token_ids=b"\x01\x00\x00\x00", lengths=[1], dimensions=8)
    again = tulip_pb2.EmbedRequest.FromString(req.SerializeToString())
    assert again.lengths == [1] and again.dimensions == 8
    assert hasattr(tulip_pb2_grpc, "TulipStub")
    assert Path(tulip_pb2.__file__).parent == ROOT / "trellis" / "tulip" / "v1"
