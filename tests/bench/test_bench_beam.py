"""``quire bench beam`` on a tiny model: both modes run, and beam search holds fewer KV
pages at its peak than as many independent samples (its beams share pages)."""

from __future__ import annotations

import json

from quire.entrypoints.cli import main


def test_bench_beam_reports_both_modes(capsys, tmp_path, tiny_path):
    out = tmp_path / "beam.json"
    argv = ["bench", "beam", "--model", tiny_path, "--device", "cpu", "--block-size", "4",
            "--prompt", "Once upon a time there was a quiet village by the sea",
            "--beam-width", "4", "--max-tokens", "12", "--output", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert "peak KV pages" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["command"] == "beam" and result["settings"]["beam_width"] == 4
    beam, samples = result["modes"].values()
    assert beam["output_tokens"] == samples["output_tokens"] == 4 * 12
    assert 0 < beam["peak_kv_pages"] < samples["peak_kv_pages"]
    assert beam["wall_s"] > 0 and samples["wall_s"] > 0
