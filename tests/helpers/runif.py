"""``RunIf``: one skip marker for tests that need hardware or optional packages.

Example::

    @RunIf(min_cuda_gpus=1, nvml=True)
    def test_reads_nvml(): ...
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

__all__ = ["RunIf"]


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _nvml_works() -> bool:
    if not _has("pynvml"):
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def RunIf(  # noqa: N802 - reads as a marker, like Lightning's helper
    min_cuda_gpus: int = 0,
    deepspeed: bool = False,
    bnb: bool = False,
    fp8: bool = False,
    transformer_engine: bool = False,
    nvml: bool = False,
    torchao: bool = False,
    bf16_cuda: bool = False,
    min_torch: str | None = None,
    skip_windows: bool = False,
) -> pytest.MarkDecorator:
    """A ``skipif`` marker listing every unmet requirement.

    Args:
        min_cuda_gpus: at least this many CUDA devices.
        deepspeed: the ``deepspeed`` package imports.
        bnb: ``bitsandbytes`` is installed.
        fp8: a CUDA device of compute capability >= 8.9 (FP8 tensor cores).
        transformer_engine: ``transformer_engine`` is installed (the ``gpu`` extra; it builds only with CUDA).
        nvml: NVML initialises (a GPU driver is present and ``nvidia-ml-py`` installed).
        torchao: ``torchao`` is installed.
        bf16_cuda: the CUDA device supports bf16.
        min_torch: at least this torch version, e.g. ``"2.5"``.
        skip_windows: skip on Windows.
    """
    reasons: list[str] = []
    if min_cuda_gpus and torch.cuda.device_count() < min_cuda_gpus:
        reasons.append(f"needs {min_cuda_gpus} CUDA GPU(s), found {torch.cuda.device_count()}")
    if deepspeed and not _has("deepspeed"):
        reasons.append("needs deepspeed")
    if bnb and not _has("bitsandbytes"):
        reasons.append("needs bitsandbytes")
    if torchao and not _has("torchao"):
        reasons.append("needs torchao")
    if fp8 and not _fp8_capable():
        reasons.append("needs a CUDA GPU with compute capability >= 8.9 (FP8)")
    if transformer_engine and not _has("transformer_engine"):
        reasons.append("needs transformer_engine (pip install -e '.[gpu]', CUDA only)")
    if nvml and not _nvml_works():
        reasons.append("needs a working NVML (GPU driver + nvidia-ml-py)")
    if bf16_cuda and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        reasons.append("needs a CUDA GPU with bf16")
    if min_torch is not None:
        from packaging.version import Version

        if Version(torch.__version__.split("+")[0]) < Version(min_torch):
            reasons.append(f"needs torch >= {min_torch}")
    if skip_windows:
        import sys

        if sys.platform == "win32":
            reasons.append("not supported on Windows")
    # ``needs_cuda`` rides on the skipif mark (pytest reads only condition and reason); conftest turns it into the
    # ``cuda`` marker, so a GPU machine runs every such test with ``pytest -m cuda`` (bench/gpu_checks.sh).
    needs_cuda = bool(min_cuda_gpus or fp8 or transformer_engine or nvml or bf16_cuda)
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "requirements met", needs_cuda=needs_cuda)
