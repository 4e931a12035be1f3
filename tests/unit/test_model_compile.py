"""``compile=True`` and what it costs the starts that do not compile.

Methods that ``torch.compile`` must run eagerly are marked :func:`never_traced`, and only
:func:`compile_model` wraps them in ``torch.compiler.disable``: decorating at class
definition imported Dynamo in every process (docs/bench.md, "Start-up", has its cost).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from quire import LLM, SamplingParams
from quire.models.compile import _disable_marked, never_traced

PROMPTS = [[1, 17, 45, 99, 23, 7], [1, 200, 33, 9, 41, 5, 77, 12]]


@pytest.fixture(scope="module")
def tiny_gguf(random_gguf):
    return random_gguf("--preset", "tiny", "--seed", "3")


def test_an_eager_engine_never_imports_dynamo(tiny_gguf):
    script = textwrap.dedent(f"""
        import sys
        import quire.entrypoints.cli
        import quire.models.gemma3, quire.models.layers.fused_moe
        from quire import LLM, SamplingParams
        with LLM({str(tiny_gguf)!r}, device="cpu", kv_cache_memory=16 << 20) as llm:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        print("dynamo imported:", "torch._dynamo" in sys.modules)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dynamo imported: False" in done.stdout


def test_compile_model_wraps_each_marked_method_of_each_module():
    class Leaf(torch.nn.Module):
        @never_traced
        def eager(self, x):
            return x + 1

        def traced(self, x):
            return x

    class Child(Leaf):  # a marked method inherited counts too
        pass

    model = torch.nn.Sequential(Leaf(), Child())
    assert _disable_marked(model) == 2
    for module in model:
        assert getattr(module.eager, "_torchdynamo_disable", False)
        assert module.eager(torch.zeros(1)).item() == 1.0  # still the bound method
        assert not hasattr(module.traced, "_torchdynamo_disable")


@pytest.mark.slow
def test_a_compiled_model_gives_the_eager_tokens(tiny_gguf):
    """Inductor on the tiny model (a C++ compiler and a minute or two on 2 cores): the
    marked attention methods break the graph, and the tokens are the eager ones."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(**options):
        with LLM(str(tiny_gguf), device="cpu", kv_cache_memory=16 << 20,
                 quantization="none", **options) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    assert run(compile=True) == run()
