"""Quire platform plugin for Huawei Ascend NPUs (``--device ascend``).

Written against the vendor API documentation (torch_npu, CANN's fused attention
operators, HCCL), NOT run on Ascend hardware: no NPU or torch_npu was available where it
was written. Until someone runs ``quire conformance --device ascend`` on a real device,
treat it as unverified.

Modules: ``plugin`` (the entry point; imports nothing heavy), ``platform`` (availability
and factories), ``attention`` (torch_npu paged attention), ``memory`` (NPU memory
readings). ``torch_npu`` is imported by ``availability()`` and the factories only.
"""
