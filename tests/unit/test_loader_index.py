"""Weight files a checkpoint's index names must lie inside it: an untrusted index json
cannot make the loader read a file elsewhere. Links are the owner's business: a weight
file linked elsewhere (another disk, the Hugging Face cache's blobs) still loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quire.models.loader import iter_weights
from safetensors.torch import load_file

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    """A copy of the tiny llama checkpoint, its weights one shard listed by an index,
    and a copy of that shard outside it (``tmp_path/outside.safetensors``)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    (path / "model.safetensors").rename(path / SHARD)
    shutil.copy(path / SHARD, tmp_path / "outside.safetensors")
    write_index(path, SHARD)
    return path


def write_index(path: Path, file: str) -> None:
    """An index that maps every weight of the shard to ``file``."""
    weight_map = {name: file for name in load_file(path / SHARD)}
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_an_index_inside_the_checkpoint_loads(checkpoint):
    expected = load_file(checkpoint / SHARD)
    loaded = dict(iter_weights(str(checkpoint)))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


@pytest.mark.parametrize("name", ["../outside.safetensors", "absolute"])
def test_an_index_naming_a_file_outside_is_refused(checkpoint, name):
    name = str(checkpoint.parent / "outside.safetensors") if name == "absolute" else name
    write_index(checkpoint, name)
    with pytest.raises(ValueError) as refused:
        list(iter_weights(str(checkpoint)))
    assert repr(name) in str(refused.value) and str(checkpoint) in str(refused.value)


def test_a_weight_file_linked_elsewhere_loads(checkpoint):
    (checkpoint / "model.safetensors.index.json").unlink()
    (checkpoint / SHARD).unlink()
    (checkpoint / SHARD).symlink_to(checkpoint.parent / "outside.safetensors")
    assert len(dict(iter_weights(str(checkpoint)))) == len(load_file(
        checkpoint.parent / "outside.safetensors"))


def test_a_hugging_face_cache_snapshot_linking_into_its_blobs_loads(checkpoint, tmp_path):
    """``hub/models--o--n/snapshots/<rev>/*`` are links to ``../../blobs/<hash>``."""
    repo = tmp_path / "hub" / "models--o--n"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    shutil.copytree(checkpoint, snapshot, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copy(checkpoint / SHARD, repo / "blobs" / "f00d")
    (snapshot / SHARD).symlink_to(Path("../../blobs/f00d"))
    assert len(dict(iter_weights(str(snapshot)))) == len(load_file(checkpoint / SHARD))
