"""``quire bench images`` end to end on the tiny LLaVA, in seconds (no peers).

No timing is asserted: only that the command runs, prints its table, writes every
figure as a positive number, and refuses a bad flag by name.
"""

from __future__ import annotations

import json

import pytest
from quire.bench.images import IMAGE_FIGURES
from quire.entrypoints.cli import main

from tests.tiny_vlm import build_llava

SMALL = ["--device", "cpu", "--image-size", "40", "--input-len", "40", "--output-len", "3",
         "--concurrency", "2", "--repeats", "2", "--kv-cache-memory", "4MiB",
         "--block-size", "8"]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return str(build_llava(tmp_path_factory.mktemp("llava") / "tiny"))


def test_images_figures(capsys, tmp_path, llava):
    out_path = tmp_path / "images.json"
    assert main(["bench", "images", "--model", llava, *SMALL,
                 "--output", str(out_path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "TTFT, fresh image (ms)" in out and "encoder share of the TTFT" in out
    result = json.loads(out_path.read_text())
    assert result["command"] == "images"
    quire = result["results"]["quire"]
    assert len(quire["runs"]) == 2
    median = quire["median"]
    assert set(median) == {f.key for f in IMAGE_FIGURES}
    # the saving is 1 - cached/fresh TTFT: on the tiny model both take milliseconds, so
    # its sign is noise; every other figure is a positive time, count or rate
    assert all(v > 0 for k, v in median.items() if k != "prefix_saving"), median
    assert median["prefix_saving"] < 1
    # the tiny tower makes 25 embeddings; 40 text tokens around them
    assert median["prompt_tokens"] == 25 + 40
    assert median["encoder_share"] < 1
    assert result["settings"]["workload"]["concurrency"] == 2


@pytest.mark.parametrize("flag", ["--concurrency", "--repeats", "--image-size"])
def test_bad_flag_is_named(capsys, llava, flag):
    argv = ["bench", "images", "--model", llava, *SMALL]
    argv[argv.index(flag) + 1] = "0"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
