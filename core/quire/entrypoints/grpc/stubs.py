"""The gRPC stubs of ``generation.proto``: generated at build time, loaded at run time.

``compile_stubs`` runs ``grpc_tools.protoc`` (``setup.py``'s ``build_grpc_stubs`` calls
it; stdlib only here, so the build loads this file by path, without torch).
``load_stubs`` imports the generated modules. A checkout without them (an editable
install made before the proto existed), or with stubs older than the proto, has them
generated at first use in place when ``grpcio-tools`` is importable, as the cpu kernels
are built at first use; otherwise the error says how to rebuild.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
PROTO = HERE / "generation.proto"
#: The directory ``-I`` names, so that the generated modules import each other as
#: ``quire.entrypoints.grpc.*``.
INCLUDE_ROOT = HERE.parents[2]
MODULES = ("generation_pb2", "generation_pb2_grpc")
REBUILD_HINT = ("reinstall the package (`pip install --no-deps -e .` in a checkout), or "
                "install grpcio-tools, with which they are generated at first use")

logger = logging.getLogger(__name__)


def compile_stubs(out_root: Path) -> list[Path]:
    """Generate ``generation_pb2.py``, ``.pyi`` and ``generation_pb2_grpc.py`` under
    ``out_root`` (a directory holding the ``quire`` package: the source tree, or a
    wheel's build directory); returns their paths.

    :raises RuntimeError: protoc failed (its messages are on stderr), or grpc_tools is
        missing.
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise RuntimeError(f"grpcio-tools is not installed ({exc})") from exc
    import importlib.resources

    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    rel = PROTO.relative_to(INCLUDE_ROOT)
    out_root.mkdir(parents=True, exist_ok=True)
    status = protoc.main(["grpc_tools.protoc", f"-I{INCLUDE_ROOT}", f"-I{well_known}",
                          f"--python_out={out_root}", f"--pyi_out={out_root}",
                          f"--grpc_python_out={out_root}", str(rel)])
    if status != 0:
        raise RuntimeError(f"protoc failed on {rel} (status {status})")
    out_dir = out_root / rel.parent
    return [out_dir / f"{name}{ext}" for name, ext in
            (("generation_pb2", ".py"), ("generation_pb2", ".pyi"),
             ("generation_pb2_grpc", ".py"))]


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """``(generation_pb2, generation_pb2_grpc)``.

    :raises RuntimeError: the stubs are missing or stale and cannot be generated here;
        the message says how to rebuild them.
    """
    if _missing_or_stale():
        _generate_in_place()
    package = __name__.rpartition(".")[0]
    pb2, pb2_grpc = (importlib.import_module(f"{package}.{name}") for name in MODULES)
    return pb2, pb2_grpc


def _missing_or_stale() -> bool:
    built = [HERE / f"{name}.py" for name in MODULES]
    if not all(p.exists() for p in built):
        return True
    return min(p.stat().st_mtime for p in built) < PROTO.stat().st_mtime


def _generate_in_place() -> None:
    built = all((HERE / f"{name}.py").exists() for name in MODULES)
    what = "older than generation.proto" if built else "not built"
    if not os.access(HERE, os.W_OK):
        if built:  # an installed package's files: use them as they are
            return
        raise RuntimeError(f"quire's gRPC stubs are {what} in {HERE}: {REBUILD_HINT}")
    try:
        compile_stubs(INCLUDE_ROOT)
    except RuntimeError as exc:
        if built:
            logger.warning("quire's gRPC stubs are %s and could not be regenerated (%s); "
                           "using them as they are", what, exc)
            return
        raise RuntimeError(f"quire's gRPC stubs are {what} in {HERE} and could not be "
                           f"generated ({exc}): {REBUILD_HINT}") from exc
    logger.warning("quire's gRPC stubs were %s; generated them in %s", what, HERE)
    for name in MODULES:  # an import that failed before must not be remembered
        sys.modules.pop(f"{__name__.rpartition('.')[0]}.{name}", None)
    importlib.invalidate_caches()
