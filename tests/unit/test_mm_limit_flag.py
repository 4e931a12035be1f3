"""``--limit-mm-per-prompt`` takes N, ``image=N`` or vLLM's ``{"image": N}``; anything
else is refused naming the flag."""

from __future__ import annotations

import argparse

import pytest

from quire.entrypoints.cli.engine_options import add_engine_options, engine_config_from_args


def _parse(*argv: str):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_options(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("text", ["3", "image=3", '{"image": 3}'])
def test_forms(text):
    assert engine_config_from_args(_parse("--limit-mm-per-prompt", text)
                                   ).limit_mm_per_prompt == 3


@pytest.mark.parametrize("text", ["video=2", '{"image": -1}', "x", '{"image": 1, "audio": 1}'])
def test_refusals_name_the_flag(text):
    with pytest.raises(argparse.ArgumentError, match="limit-mm-per-prompt"):
        _parse("--limit-mm-per-prompt", text)
