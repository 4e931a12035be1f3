"""``LoRARequest``: which adapter a request runs with (vLLM's names and fields)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """An adapter in PEFT's format at ``lora_path``, known to the engine by
    ``lora_int_id`` (>= 1; the same id must always mean the same adapter) and shown as
    ``lora_name``."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must be a non-empty path, got "
                             f"{self.lora_path!r}")
