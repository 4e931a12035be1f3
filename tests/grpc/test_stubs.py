"""The gRPC stubs: generated from the proto (as the package build does), regenerated
when older than the proto, and a clear error when they cannot be had."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from quire.entrypoints.grpc import stubs


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A source tree of its own holding only the proto, which ``stubs`` works on."""
    here = tmp_path / "quire" / "entrypoints" / "grpc"
    here.mkdir(parents=True)
    shutil.copy(stubs.PROTO, here / "generation.proto")
    monkeypatch.setattr(stubs, "HERE", here)
    monkeypatch.setattr(stubs, "PROTO", here / "generation.proto")
    monkeypatch.setattr(stubs, "INCLUDE_ROOT", tmp_path)
    return here


def test_missing_stubs_are_generated_and_stale_ones_again(tree):
    assert stubs._missing_or_stale()
    stubs._generate_in_place()
    assert not stubs._missing_or_stale()
    text = (tree / "generation_pb2_grpc.py").read_text()
    assert "quire.v1.Generation" in text
    assert "from quire.entrypoints.grpc import generation_pb2" in text
    later = (tree / "generation_pb2.py").stat().st_mtime + 10
    os.utime(tree / "generation.proto", (later, later))  # the proto was edited since
    assert stubs._missing_or_stale()


def test_missing_stubs_without_grpc_tools_say_how_to_rebuild(tree, monkeypatch):
    monkeypatch.setitem(sys.modules, "grpc_tools", None)  # import grpc_tools fails
    with pytest.raises(RuntimeError) as info:
        stubs.load_stubs()
    message = str(info.value)
    assert "not built" in message and "pip install --no-deps -e ." in message
    assert "grpcio-tools" in message


def test_a_proto_that_does_not_compile_is_an_error(tree):
    (tree / "generation.proto").write_text("syntax = 'proto3'; message {")
    with pytest.raises(RuntimeError, match="protoc failed"):
        stubs.compile_stubs(tree.parents[2])
