"""The models ``quire serve`` serves: ``--model`` repeated, or ``model:`` mappings in
``--config``, each refused item named."""

from __future__ import annotations

import pytest
from quire.entrypoints.cli import build_parser, parse_args
from quire.entrypoints.cli.common import UsageError
from quire.entrypoints.cli.model_list import model_entries, single_model


def _args(argv: list[str], tmp_path=None, yaml: str | None = None):
    if yaml is not None:
        path = tmp_path / "serve.yaml"
        path.write_text(yaml)
        argv = [*argv, "--config", str(path)]
    return parse_args(build_parser(), ["serve", *argv])


def test_repeated_models_get_their_names_in_order():
    entries = model_entries(_args(["--model", "A", "--model", "B", "--served-model-name",
                                   "a", "b", "--max-num-seqs", "8"]))
    assert [(e.name, e.config.model, e.config.max_num_seqs) for e in entries] == \
        [("a", "A", 8), ("b", "B", 8)]
    entries = model_entries(_args(["--model", "A", "--model", "B"]))
    assert [e.name for e in entries] == ["A", "B"]  # by default, as given


def test_mappings_in_the_config_carry_their_own_options(tmp_path):
    args = _args(["--max-num-seqs", "4"], tmp_path, yaml=(
        "model:\n"
        "  - {model: A, served_model_name: a, max_num_seqs: 16, tool_call_parser: hermes}\n"
        "  - {model: B, max-num-batched-tokens: 512}\n"))
    a, b = model_entries(args)
    assert (a.name, a.config.max_num_seqs, a.options["tool_call_parser"]) == \
        ("a", 16, "hermes")
    assert (b.name, b.config.max_num_seqs, b.config.max_num_batched_tokens) == ("B", 4, 512)


@pytest.mark.parametrize(("argv", "yaml", "message"), [
    (["--model", "A", "--model", "B", "--served-model-name", "a"], None,
     "--served-model-name: 1 names for 2 models"),
    (["--model", "A", "--model", "A"], None, "two models are served as 'A'"),
    ([], "model:\n  - {model: A, kv_cache_memory: 1GiB}\n  - B\n",
     "kv_cache_memory is the server's"),
    ([], "model:\n  - {model: A, max_num_seqz: 2}\n  - B\n", "unknown key 'max_num_seqz'"),
    ([], "model:\n  - {served_model_name: a}\n  - B\n", "needs a 'model' key"),
    ([], "model:\n  - {model: A, tool_call_parser: nope}\n  - B\n",
     "tool_call_parser 'nope' is not one of"),
    ([], "model:\n  - {model: A, max_num_seqs: 0}\n  - B\n", "model 1 (A): --max-num-seqs"),
])
def test_bad_model_lists_are_refused_naming_the_item(tmp_path, argv, yaml, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_entries(_args(argv, tmp_path, yaml))


def test_every_other_command_takes_one_model():
    args = _args(["--model", "A", "--served-model-name", "a"])
    single_model(args)
    assert (args.model, args.served_model_name) == ("A", "a")
    with pytest.raises(UsageError, match="one name per --model"):
        single_model(_args(["--served-model-name", "a", "b"]))
