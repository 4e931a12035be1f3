"""The command line's shared behaviour: --config files, errors naming flags, `quire models`."""

from __future__ import annotations

import pytest
from quire.entrypoints.cli import build_parser, main, parse_args
from quire.entrypoints.cli.common import UsageError


def test_config_file_supplies_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 7\nblock_size: 32\nenable-prefix-caching: false\n"
                      "kv-cache-memory: 1GiB\nmax-tokens: 5\n")
    args = parse_args(build_parser(), ["generate", "--config", str(config), "--block-size", "8"])
    assert args.max_num_seqs == 7
    assert args.block_size == 8  # the command line wins
    assert args.enable_prefix_caching is False
    assert args.kv_cache_memory == 2**30
    assert args.max_tokens == 5


def test_unknown_config_key_is_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max-num-seqs: 7\nmax-num-sequences: 9\n")
    with pytest.raises(UsageError, match="unknown key 'max-num-sequences'"):
        parse_args(build_parser(), ["generate", "--config", str(config)])


@pytest.mark.parametrize("text, message", [("- a\n- b\n", "mapping"), ("a: [1,\n", "YAML")])
def test_malformed_config_files_are_refused(tmp_path, capsys, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert main(["generate", "--config", str(config), "-p", "x"]) == 2
    assert message in capsys.readouterr().err


def test_bad_engine_flag_value_names_the_flag(capsys):
    assert main(["generate", "-p", "x", "--block-size", "0"]) == 2
    assert "--block-size" in capsys.readouterr().err


def test_models_lists_the_builtin_default(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct (default): not cached" in out
    assert str(tmp_path) in out
