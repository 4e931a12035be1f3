"""The cpu platform's options: typed, checked once, from ``EngineConfig.platform_options``.

Each option may take its default from an environment variable (``QUIRE_CPU_*``), so a
deployment can set one for every engine; a value in ``platform_options`` wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from quire.platforms.cpu.isa import LEVEL_NAMES
from quire.platforms.cpu.kv_prefault import MODES as PREFAULT_MODES

#: Option -> the environment variable that may set its default.
ENV_DEFAULTS = {
    "attention": "QUIRE_CPU_ATTENTION",
    "linear": "QUIRE_CPU_LINEAR",
    "compact": "QUIRE_CPU_COMPACT",
    "native": "QUIRE_CPU_NATIVE",
    "threads": "QUIRE_CPU_THREADS",
    "isa": "QUIRE_CPU_ISA",
    "wait_policy": "QUIRE_CPU_WAIT_POLICY",
    "kv_prefault": "QUIRE_CPU_KV_PREFAULT",
    "decode_activations": "QUIRE_CPU_DECODE_ACTIVATIONS",
    "activations": "QUIRE_CPU_ACTIVATIONS",
}
_BOOLS = ("compact", "native")
_CHOICES = {"attention": ("sdpa", "reference"), "linear": ("packed", "torch"),
            "wait_policy": ("auto", "spin", "passive"),
            "kv_prefault": PREFAULT_MODES,
            "decode_activations": ("auto", "float32", "bfloat16", "int8"),
            "activations": ("auto", "dtype", "bfloat16", "int8")}


@dataclass(frozen=True)
class CpuOptions:
    """How the cpu platform runs a model.

    :raises ValueError: naming the option and what it accepts.
    """

    #: ``sdpa`` (torch's fused SDPA, C decode attention) or ``reference`` (the oracle).
    attention: str = "sdpa"
    #: ``packed`` (weights packed once for the C panel kernel or oneDNN) or ``torch``
    #: (plain ``F.linear``, what Hugging Face runs).
    linear: str = "packed"
    #: Keep exact compact copies of weights for one-row products (and so fused layers).
    compact: bool = True
    #: Build and use the C kernels (needs a C compiler).
    native: bool = True
    #: torch threads; None: the cores this process may use, unless the user set torch's.
    threads: int | None = None
    #: The C kernels' ISA level (:mod:`~quire.platforms.cpu.isa`), e.g. ``avx2`` on an
    #: AVX-512 host to compare paths; None: the best the CPU has.
    isa: str | None = None
    #: How idle OpenMP threads of the engine processes Quire starts wait: ``spin``
    #: (libgomp's default), ``passive``, or ``auto`` (passive when other processes load
    #: this engine's cores); ``OMP_WAIT_POLICY``, when set, wins
    #: (:func:`~quire.platforms.cpu.threads.choose_wait_policy`).
    wait_policy: str = "auto"
    #: When the KV pool's pages become resident (the ``sdpa`` attention's pool; the
    #: reference's faults in as ever). A fresh page's first write costs a fault, and
    #: under a hypervisor that backs memory lazily a far dearer one in the host: paid
    #: inside whichever step first reaches the page, unless done before.
    #: ``background``: a thread on idle CPU keeps 512 MiB of the pool populated ahead
    #: of the blocks steps have reached, without writing it
    #: (:mod:`~quire.platforms.cpu.kv_prefault`);
    #: ``start``: the whole pool written at allocation, as vLLM and llama.cpp do (the
    #: start waits for it); ``off``: each page faults in on its first write, and the
    #: resident memory follows use (docs/bench.md, "first touch").
    kv_prefault: str = "background"
    #: The activations of decode rows' products on quantised weights (``quantization``
    #: gguf, int8, fp8; up to 8 rows, the direct path's): ``float32``, the dequantised
    #: model's products exactly; ``bfloat16``, each row rounded to bfloat16 times the
    #: exact weights, float32 sums (csrc/quant_gemm.c: Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
    #: Q5_K, Q6_K with AVX512_BF16; other formats and CPUs stay float32); ``int8``, each
    #: row quantised per 32 values with integer dot products, as llama.cpp does
    #: (csrc/quant_q8.c: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; other formats
    #: stay float32); or ``auto``: ``bfloat16`` where a layer's batched products take
    #: bfloat16 (``activations`` below), ``float32`` elsewhere. A bfloat16 model's rows,
    #: already bfloat16, take the bfloat16 rows unless ``int8``. Prompts and larger
    #: batches take what ``activations`` says.
    decode_activations: str = "auto"
    #: The activations of every product on quantised weights (GGUF blocks, int8, fp8):
    #: ``dtype``, the model's (float32, or a bfloat16 model's bfloat16 rows on
    #: bfloat16-rounded weights), with decode rows as ``decode_activations`` says;
    #: ``bfloat16``, a float32 model's products of more rows than a decode's rounded to
    #: bfloat16 on the bfloat16 (AMX) kernel, float32 sums and results, the rest of the
    #: model (residual stream, norms, attention, logits) kept in float32, as PyTorch's
    #: ``float32_matmul_precision="medium"`` does (needs AVX512_BF16; without it the
    #: products stay float32, which is logged); ``int8``, every row, prompts' and
    #: batches' too, quantised per 32 values as ``decode_activations=int8`` does (which
    #: it implies), batches on csrc/quant_q8.c's batch kernel, which unpacks the weight
    #: once a call (AVX2 and AVX-512; the generic level takes them on the tiles of up to
    #: four rows), the formats as ``decode_activations``'; or ``auto``: ``bfloat16``
    #: where the build has the bfloat16 kernel (AVX512_BF16, AMX or not) and ``dtype`` is
    #: left to ``auto``, ``dtype`` otherwise (an explicit ``--dtype float32`` keeps
    #: float32 products; the accuracy and speed of each: docs/quantization.md,
    #: "Activations"). Where a float32 model's
    #: products take bfloat16, ``kv_cache_dtype=auto`` gives it bfloat16 KV pages too.
    activations: str = "auto"

    @property
    def int8_decode(self) -> bool:
        """Whether decode rows' products take int8 activations (either option)."""
        return self.decode_activations == "int8" or self.activations == "int8"

    @property
    def bf16_decode(self) -> bool | None:
        """Whether a float32 model's decode rows take bfloat16 activations: True, False,
        or None where each layer follows its batched products' (``auto``)."""
        if self.int8_decode:
            return False
        return {"bfloat16": True, "float32": False}.get(self.decode_activations)

    def __post_init__(self) -> None:
        for name, accepted in _CHOICES.items():
            if getattr(self, name) not in accepted:
                raise ValueError(f"cpu option {name}={getattr(self, name)!r}: expected one "
                                 f"of {', '.join(accepted)}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"cpu option {name} must be true or false")
        if self.threads is not None and (isinstance(self.threads, bool)
                                         or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"cpu option threads must be a positive integer, got "
                             f"{self.threads!r}")
        if self.isa is not None and self.isa not in LEVEL_NAMES:
            raise ValueError(f"cpu option isa={self.isa!r}: expected one of "
                             f"{', '.join(LEVEL_NAMES)}")

    @classmethod
    def parse(cls, options: Mapping[str, Any], env: Mapping[str, str]) -> CpuOptions:
        """Options from ``options`` (strings accepted, as a CLI gives them), defaults
        from ``env`` (:data:`ENV_DEFAULTS`), then the field defaults.

        :raises ValueError: naming an unknown option (and the known ones) or a bad value
            (and where it came from).
        """
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown cpu option(s) {', '.join(unknown)}; known: "
                             f"{', '.join(known)}")
        values: dict[str, Any] = {}
        for name in known:
            if name in options:
                raw, source = options[name], f"platform option {name}"
            elif env.get(ENV_DEFAULTS[name], "").strip():
                raw, source = env[ENV_DEFAULTS[name]], ENV_DEFAULTS[name]
            else:
                continue
            values[name] = _convert(name, raw, source)
        return cls(**values)


def _convert(name: str, raw: Any, source: str) -> Any:
    if not isinstance(raw, str):
        return raw
    text = raw.strip().lower()
    if name in _CHOICES and text not in _CHOICES[name]:
        raise ValueError(f"{source}={raw!r}: expected one of {', '.join(_CHOICES[name])}")
    if name in _BOOLS:
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{source}={raw!r}: expected true or false (1 or 0)")
    if name == "isa" and text not in LEVEL_NAMES:
        raise ValueError(f"{source}={raw!r}: expected one of {', '.join(LEVEL_NAMES)}")
    if name == "threads":
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{source}={raw!r}: expected a positive integer")
        return int(text)
    return text
