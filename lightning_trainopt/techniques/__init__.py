"""Memory techniques for any ``nn.Module``: checkpointing, offload, 8-bit activations, optimizers, micro-batch."""

from lightning_trainopt.techniques.blocks import block_classes
from lightning_trainopt.techniques.checkpointing import (
    CheckpointPlan,
    CheckpointPolicy,
    apply_activation_checkpointing,
    find_block_list,
    is_checkpointed,
    remove_activation_checkpointing,
    select_modules,
    self_checkpointing_modules,
)
from lightning_trainopt.techniques.compression import (
    Int8Compressor,
    QuantizedTensor,
    dequantize_blockwise,
    gradient_relative_error,
    quantize_blockwise,
)
from lightning_trainopt.techniques.micro_batch import (
    MicroBatchPlan,
    divisors,
    fit_linear_bytes,
    nearby_global_batches,
    plan_micro_batch,
)
from lightning_trainopt.techniques.offload import CpuOffloader
from lightning_trainopt.techniques.optimizer_states import OptimizerStateReport, optimizer_state_bytes
from lightning_trainopt.techniques.optimizers import adamw, bitsandbytes_optimizer, torchao_optimizer
from lightning_trainopt.techniques.regional_compile import compile_blocks

__all__ = [
    "CheckpointPlan",
    "CheckpointPolicy",
    "CpuOffloader",
    "Int8Compressor",
    "MicroBatchPlan",
    "OptimizerStateReport",
    "QuantizedTensor",
    "adamw",
    "apply_activation_checkpointing",
    "bitsandbytes_optimizer",
    "block_classes",
    "compile_blocks",
    "dequantize_blockwise",
    "divisors",
    "find_block_list",
    "fit_linear_bytes",
    "gradient_relative_error",
    "is_checkpointed",
    "nearby_global_batches",
    "optimizer_state_bytes",
    "plan_micro_batch",
    "quantize_blockwise",
    "remove_activation_checkpointing",
    "select_modules",
    "self_checkpointing_modules",
    "torchao_optimizer",
]
