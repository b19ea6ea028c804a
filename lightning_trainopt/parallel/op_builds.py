"""Say which DeepSpeed C++ ops a run is about to compile, so a first run does not look hung.

DeepSpeed compiles some of its ops with ninja the first time they are used and caches them under torch's
extensions directory. On a 2-core machine that takes about 20 s (the CPU shared-memory all-reduce), 35 s (CPU Adam)
and 140 s (async I/O for NVMe offload), with nothing printed while it runs, because Lightning keeps DeepSpeed's
logger at WARNING.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_trainopt._compat.torch_internals import extension_build_dir

__all__ = ["OpBuild", "announce_op_builds", "op_builds_needed"]


@dataclass(frozen=True)
class OpBuild:
    """One DeepSpeed op a run needs: its builder class, its extension name, why it is needed, about how long."""

    builder: str
    name: str
    reason: str
    seconds: int


# Build times measured cold on the 2-core development machine (shared/FINDINGS.md, "Install").
_SHM = OpBuild("ShareMemCommBuilder", "deepspeed_shm_comm", "CPU shared-memory collectives", 20)
_CPU_ADAM = OpBuild("CPUAdamBuilder", "cpu_adam", "CPU Adam for optimizer offload", 35)
_AIO = OpBuild("AsyncIOBuilder", "async_io", "async I/O for NVMe offload", 140)


def op_builds_needed(on_cpu: bool, offload: dict[str, str]) -> list[OpBuild]:
    """The JIT-built ops a DeepSpeed run loads: pure, from where it runs and where it offloads.

    Args:
        on_cpu: the ranks are CPU processes (DeepSpeed then loads its shared-memory collectives).
        offload: ``{"optimizer": ..., "param": ...}``, each ``none``, ``cpu`` or ``nvme``.
    """
    ops = [_SHM] if on_cpu else []
    if offload.get("optimizer", "none") != "none":
        ops.append(_CPU_ADAM)
    if "nvme" in (offload.get("optimizer"), offload.get("param")):
        ops.append(_AIO)
    return ops


def _is_built(op: OpBuild) -> bool:
    """Installed pre-compiled with DeepSpeed (``DS_BUILD_OPS=1``), or already in torch's JIT extension cache."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        installed_ops = {}
    if installed_ops.get(op.name, False):
        return True
    return os.path.isfile(os.path.join(extension_build_dir(op.name), f"{op.name}.so"))


def announce_op_builds(on_cpu: bool, offload: dict[str, str]) -> str | None:
    """One line naming the ops this run will compile before their first use, or ``None`` when all are cached."""
    todo = [op for op in op_builds_needed(on_cpu, offload) if not _is_built(op)]
    if not todo:
        return None
    what = ", ".join(f"{op.name} ({op.reason})" for op in todo)
    total = sum(op.seconds for op in todo)
    return (
        f"DeepSpeed is compiling {what} on first use: about {total} s on 2 CPU cores, once; "
        "later runs load it from torch's extension cache."
    )
