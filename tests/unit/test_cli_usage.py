"""What a new user meets first: each flag's help states its default once, usage errors
come from the subcommand that was run, and ``quire models`` says what each model serves."""

from __future__ import annotations

import argparse
import dataclasses
import re
from types import SimpleNamespace

import pytest
from quire.config import EngineConfig
from quire.entrypoints.cli import build_parser, main
from quire.entrypoints.cli.common import UsageError
from quire.entrypoints.server.errors import APIError
from quire.entrypoints.server.protocol import render_chat


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(words, parser) of every command that runs: ``("bench", "throughput")``, ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = list(_leaves(sub, (*path, name)))
                yield from nested or [((*path, name), sub)]


LEAVES = list(_leaves(build_parser()))
LEAF_WORDS = [words for words, _ in LEAVES]


def test_the_leaves_include_nested_subcommands():
    assert {("serve",), ("generate",), ("bench", "throughput"), ("models",)} <= set(LEAF_WORDS)


@pytest.mark.parametrize("words, parser", LEAVES, ids=[" ".join(w) for w, _ in LEAVES])
def test_each_flag_states_its_default_at_most_once_and_never_none(words, parser):
    for action in parser._actions:
        text = parser._get_formatter()._expand_help(action) if action.help else ""
        assert len(re.findall(r"default: ", text)) <= 1, (action.option_strings, text)
        assert "(default: None)" not in text, (action.option_strings, text)
        assert "(default: True)" not in text and "(default: False)" not in text, text


def test_every_engine_flag_states_its_default_truly():
    parser = dict(LEAVES)[("generate",)]
    helps = {a.dest: parser._get_formatter()._expand_help(a) for a in parser._actions}
    for f in dataclasses.fields(EngineConfig):
        assert helps[f.name].count("default: ") == 1, (f.name, helps[f.name])
    assert helps["revision"].endswith("(default: main)")
    assert helps["tokenizer"].endswith("(default: the model's)")
    assert helps["block_size"].endswith("(default: the platform's)")
    assert helps["max_model_len"].endswith("(default: the model's)")
    assert "(default: 2048, at least max_model_len" in helps["max_num_batched_tokens"]
    assert helps["max_num_seqs"].endswith("(default: 256)")
    assert helps["enable_prefix_caching"].endswith("(default: true)")


def test_generate_describes_sampling_as_well_as_greedy():
    description = dict(LEAVES)[("generate",)].description
    assert "greedy by default" in description and "--temperature" in description


#: The flags a command requires, without which argparse reports those first.
REQUIRED = {("bench", "serve"): ["--url", "http://127.0.0.1:9"],
            ("bench", "install-peer"): ["hf"], ("conformance",): ["--device", "cpu"]}


@pytest.mark.parametrize("words", LEAF_WORDS, ids=[" ".join(w) for w in LEAF_WORDS])
def test_an_unknown_flag_is_reported_by_the_subcommand(words, capsys):
    assert main([*words, *REQUIRED.get(words, []), "--bogus"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    prog = "quire " + " ".join(words)
    assert lines[0].startswith(f"usage: {prog} "), lines[0]
    assert lines[-1] == f"{prog}: error: unrecognized arguments: --bogus"


def test_an_extra_word_after_serve_is_reported_by_serve(capsys):
    assert main(["serve", "model-a", "model-b"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "quire serve: error: unrecognized arguments: model-b")


def test_a_config_error_names_the_command_and_the_key(tmp_path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 1.5\n")
    assert main(["serve", "--config", str(config)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"quire serve: error: --config {config}: max-num-seqs: invalid "
                           "value 1.5"), line
    config.write_text("bogus: 1\n")
    assert main(["bench", "throughput", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(
        f"quire bench throughput: error: --config {config}: unknown key 'bogus'")


def test_models_says_which_builtin_models_can_chat(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path))
    assert main(["models"]) == 0
    lines = {line.split(":")[0].split(" ")[0]: line
             for line in capsys.readouterr().out.splitlines()}
    assert lines["SmolLM2-135M-Instruct"].endswith("serves chat and completions")
    assert "no chat template" in lines["gemma3-270m"]
    assert "--chat-template FILE" in lines["gemma3-270m"]
    assert lines["all-MiniLM-L6-v2"].endswith("serves embeddings only (/v1/embeddings)")


def test_the_server_names_the_flag_when_a_model_has_no_chat_template():
    tokenizer = SimpleNamespace(chat_template=None)
    with pytest.raises(APIError) as raised:
        render_chat([{"role": "user", "content": "hi"}], tokenizer, None)
    assert raised.value.status == 400
    assert "--chat-template FILE" in raised.value.message


def test_generate_chat_names_the_flag_when_a_model_has_no_chat_template(capsys):
    from quire.entrypoints.cli.generate import _check_chat_template

    llm = SimpleNamespace(engine=SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None)))
    with pytest.raises(UsageError, match="--chat: .*--chat-template FILE"):
        _check_chat_template(llm, None)
    _check_chat_template(llm, "{{ messages }}")  # a template given: fine
    assert main(["generate", "-p", "x", "--chat-template", "t.jinja"]) == 2
    assert capsys.readouterr().err.startswith(
        "quire generate: error: --chat-template: applies with --chat")


@pytest.mark.parametrize("flags, named", [
    (["--task", "generate", "--pooling", "mean"], "--pooling"),  # not --model ("models")
    (["--async-scheduling", "--pipeline-parallel-size", "2"], "--async-scheduling"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1GiB"],
     "--gpu-memory-utilization"),
    (["--block-size", "0"], "--block-size"),
])
def test_an_engine_flag_refused_is_the_flag_the_message_is_about(capsys, flags, named):
    assert main(["generate", "-p", "x", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"quire generate: error: {named}: ")


def test_an_error_of_loading_names_the_flag_only_when_it_is_about_one():
    from quire.entrypoints.cli.engine_options import engine_error

    about = ValueError("max_model_len=99999 exceeds the model's context of 256")
    assert str(engine_error(about)) == f"--max-model-len: {about}"
    for passing in ("the model's config.json has no model_type",
                    "no memory left for the KV cache: 10 bytes free"):
        assert str(engine_error(ValueError(passing))) == passing
