"""Functions that rewrite a model: activation checkpointing, offload, 8-bit activations, compile, attention, loss."""

from lightning_trainopt.transforms.blocks import block_classes
from lightning_trainopt.transforms.checkpointing import (
    CheckpointPlan,
    CheckpointPolicy,
    apply_activation_checkpointing,
    find_block_list,
    is_checkpointed,
    remove_activation_checkpointing,
    select_modules,
    self_checkpointing_modules,
)
from lightning_trainopt.transforms.compile import compile_blocks, compile_model
from lightning_trainopt.transforms.compression import (
    Int8Compressor,
    QuantizedTensor,
    dequantize_blockwise,
    gradient_relative_error,
    quantize_blockwise,
)
from lightning_trainopt.transforms.offload import CpuOffloader

__all__ = [
    "CheckpointPlan",
    "CheckpointPolicy",
    "CpuOffloader",
    "Int8Compressor",
    "QuantizedTensor",
    "apply_activation_checkpointing",
    "block_classes",
    "compile_blocks",
    "compile_model",
    "dequantize_blockwise",
    "find_block_list",
    "gradient_relative_error",
    "is_checkpointed",
    "quantize_blockwise",
    "remove_activation_checkpointing",
    "select_modules",
    "self_checkpointing_modules",
]
