"""LoRA adapters against PEFT: greedy output with three random adapters of different
ranks and targets, mixed in one batch with base-model requests on the same prompts,
equals PEFT + transformers float32 token for token, on the tiny llama and the tiny
qwen3; again after adapters were evicted from the device slots and from host memory.
Bad adapters are refused naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter, peft_greedy
from quire import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 42, 9, 77, 3, 101, 64], [12, 7, 7, 12, 7, 7, 12, 7, 99, 98]]
#: (rank, alpha, targets, rslora) of each adapter
ADAPTERS = [(4, 8, ["q_proj", "v_proj"], False),
            (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], False),
            (2, 4, ["o_proj", "up_proj", "down_proj"], True)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = [make_adapter(base, root / f"a{i}", *spec, seed=i)
                for i, spec in enumerate(ADAPTERS)]
    return base, adapters


def test_mixed_adapters_equal_peft_token_for_token(setup):
    base, adapters = setup
    max_tokens = 12
    loras = [None, *[LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]]
    prompts, requests = [], []
    for prompt in PROMPTS:  # the same prompts under every adapter: no page is shared
        for lora in loras:
            prompts.append({"prompt_token_ids": prompt})
            requests.append(lora)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # two device slots and two host copies for three adapters: evictions and reloads
    with LLM(str(base), device="cpu", block_size=4, enable_lora=True, max_loras=2,
             max_lora_rank=8, max_cpu_loras=2) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                               lora_request=requests)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params,
                                                               lora_request=requests[::-1])]
        stats = llm.engine.core.stats()
    assert again[::-1] == first
    want = [peft_greedy(base, None if lora is None else Path(lora.lora_path),
                        p["prompt_token_ids"], max_tokens)
            for p, lora in zip(prompts, requests)]
    assert first == want
    # every adapter changed the output of some prompt (the test is not vacuous)
    for i in range(1, len(loras)):
        assert any(first[j * len(loras) + i] != first[j * len(loras)]
                   for j in range(len(PROMPTS)))
    assert stats.prefix_hits > 0  # the second pass hit each adapter's own pages


def test_bad_adapters_are_refused_naming_the_problem(setup, tmp_path, tiny_checkpoint):
    base, adapters = setup
    good = LoRARequest("a0", 1, str(adapters[0]))
    params = SamplingParams(max_tokens=2)
    with LLM(str(base), device="cpu") as llm:
        with pytest.raises(ValueError, match="LoRA is disabled"):
            llm.generate([PROMPTS[0]], params, lora_request=good)
    with LLM(str(base), device="cpu", enable_lora=True, max_lora_rank=4) as llm:
        def refused(lora: LoRARequest, match: str) -> None:
            with pytest.raises(ValueError, match=match):
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, lora_request=lora)

        refused(LoRARequest("x", 2, str(tmp_path)), "not a LoRA adapter: it has no "
                                                    "adapter_config.json")
        refused(LoRARequest("big", 3, str(adapters[1])), "rank 8 .* exceeds "
                                                         "max_lora_rank=4")
        experts = tmp_path / "experts"
        shutil.copytree(adapters[0], experts)
        config = json.loads((experts / "adapter_config.json").read_text())
        config["target_modules"] = ["q_proj", "experts"]
        (experts / "adapter_config.json").write_text(json.dumps(config))
        refused(LoRARequest("experts", 4, str(experts)), r"target module 'experts' is "
                                                         r"not supported yet")
        deeper = tmp_path / "deeper"
        shutil.copytree(adapters[0], deeper)
        _rename_layer(deeper, 0, 7)
        refused(LoRARequest("deeper", 5, str(deeper)), r"model\.layers\.7\.self_attn\."
                                                       r"q_proj' does not exist")
        other = tmp_path / "other"
        shutil.copytree(adapters[0], other)
        _widen(other)
        refused(LoRARequest("other", 6, str(other)), "the adapter's base model differs")
        # a good adapter still runs after all that; its id keeps its path
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, lora_request=good)
        assert len(out[0].outputs[0].token_ids) == 2
        refused(LoRARequest("again", 1, str(adapters[2])), "lora_int_id 1 is already")
        assert not llm.engine.core.has_unfinished_requests()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path / "adapter_model.safetensors")


def _rename_layer(path: Path, old: int, new: int) -> None:
    _save(path, {k.replace(f"layers.{old}.", f"layers.{new}."): v
                 for k, v in _tensors(path).items()})


def _widen(path: Path) -> None:
    """The same adapter as if made for a base model of twice the hidden size."""
    _save(path, {k: torch.cat((v, v), dim=1) if "lora_A" in k else v
                 for k, v in _tensors(path).items()})
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.slow  # about a minute: SmolLM2 through PEFT, token by token
def test_smollm2_q4_blocks_with_adapters_equal_peft(smollm2_gguf, tmp_path):
    """The quantised base (the GGUF file's Q4_1 blocks) with two rank-16 adapters on
    every product, mixed with base requests: PEFT over transformers' dequantised float32
    model gives the same greedy tokens."""
    from quire.models.gguf_hf_cache import hf_dir_for_gguf
    from tiny_models import hf_greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir_for_gguf(str(smollm2_gguf)))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, return_dict=False)
               for text in ("Name three colours.", "What is two plus two?")]

    def base_model():
        return AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = []
    for i in range(2):
        wrapped = peft.get_peft_model(base_model(), peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_" in name:
                    param.copy_(0.04 * torch.randn(param.shape, generator=g))
        wrapped.save_pretrained(tmp_path / f"a{i}")
        adapters.append(tmp_path / f"a{i}")
    loras = [None, *[LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]]
    cases = [(p, lora) for p in prompts for lora in loras]
    max_tokens = 16
    # float32 products, as the oracle's (activations=auto takes bfloat16 on AMX hosts)
    with LLM(str(smollm2_gguf), device="cpu", max_model_len=256, enable_lora=True,
             max_loras=2, platform_options={"activations": "dtype"}) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p, _ in cases],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            lora_request=[lora for _, lora in cases])]
    want = []
    for prompt, lora in cases:
        model = base_model()
        if lora is not None:
            model = peft.PeftModel.from_pretrained(model, lora.lora_path).eval()
        want.append(hf_greedy(model, prompt, max_tokens))
    assert got == want
    n = len(loras)  # each adapter changes some prompt's output (the test is not vacuous)
    for i in range(1, n):
        assert any(got[j * n + i] != got[j * n] for j in range(len(prompts)))


def test_adapters_reach_a_worker_process_by_path(setup):
    """With the ``mp`` executor the adapters' paths cross to the worker in the step's
    items (once per table sent): the same tokens as in this process."""
    base, adapters = setup
    loras = [None, *[LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for backend in ("uni", "mp"):
        with LLM(str(base), device="cpu", block_size=4, enable_lora=True, max_loras=2,
                 max_lora_rank=8, distributed_executor_backend=backend) as llm:
            runs.append([o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": PROMPTS[0]}] * len(loras), params,
                lora_request=loras)])
    assert runs[1] == runs[0]
    assert len(set(map(tuple, runs[0]))) > 1  # the adapters changed the output


def test_tensor_parallel_adapters_equal_peft(setup):
    """With two ranks each holds its layers' part of every adapter (B's rows of q/k/v
    and gate/up, A's columns of o and down, whose updates are summed over the ranks):
    the greedy tokens of mixed adapters equal PEFT's."""
    base, adapters = setup
    loras = [None, *[LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(loras))]
    with LLM(str(base), device="cpu", block_size=4, enable_lora=True, max_loras=2,
             max_lora_rank=8, tensor_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                             lora_request=loras)]
    want = [peft_greedy(base, None if lora is None else Path(lora.lora_path),
                        p["prompt_token_ids"], 8) for p, lora in zip(prompts, loras)]
    assert got == want


@pytest.mark.parametrize("tp", [1, 2])
def test_embedding_and_lm_head_adapters_equal_peft(setup, tmp_path, tp):
    """Adapters on the token embedding and the LM head (PEFT's ``lora_embedding_A/B``
    and a product on the head), mixed with a decoder-layer adapter and the base model:
    greedy tokens equal PEFT's, on one rank and on two."""
    base, adapters = setup
    edges = make_adapter(base, tmp_path / "edges", 4, 8, ["embed_tokens", "lm_head"],
                         False, seed=11)
    mixed = make_adapter(base, tmp_path / "mixed", 8, 8, ["embed_tokens", "q_proj",
                                                          "down_proj", "lm_head"],
                         True, seed=12)
    loras = [None, LoRARequest("edges", 1, str(edges)), LoRARequest("mixed", 2, str(mixed)),
             LoRARequest("a0", 3, str(adapters[0]))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[1]}] * len(loras)
    extra = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp > 1 \
        else {}
    with LLM(str(base), device="cpu", block_size=4, enable_lora=True, max_loras=3,
             max_lora_rank=8, **extra) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                             lora_request=loras)]
    want = [peft_greedy(base, None if lora is None else Path(lora.lora_path),
                        p["prompt_token_ids"], 8) for p, lora in zip(prompts, loras)]
    assert got == want
    assert got[1] != got[0] and got[2] != got[0]  # the adapters changed the output
