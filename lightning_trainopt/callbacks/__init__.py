"""Callbacks that measure, guard and cut the memory of training; each is a thin adapter over ``core``/``techniques``."""

from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_trainopt.callbacks.activation_compression import ActivationCompression
from lightning_trainopt.callbacks.activation_offload import ActivationOffload
from lightning_trainopt.callbacks.cost_monitor import CostMonitor
from lightning_trainopt.callbacks.fit_report import FitReport
from lightning_trainopt.callbacks.gpu_monitor import GPUMonitor
from lightning_trainopt.callbacks.memory_breakdown import MemoryBreakdown
from lightning_trainopt.callbacks.memory_snapshot import MemorySnapshot
from lightning_trainopt.callbacks.micro_batch_finder import MicroBatchFinder
from lightning_trainopt.callbacks.non_finite_guard import NonFiniteGuard
from lightning_trainopt.callbacks.precision_report import PrecisionReport
from lightning_trainopt.callbacks.resumable_checkpoint import ResumableCheckpoint
from lightning_trainopt.callbacks.speed_monitor import SpeedMonitor
from lightning_trainopt.callbacks.step_timer import StepTimer
from lightning_trainopt.callbacks.warmup_cosine_lr import WarmupCosineLR

__all__ = [
    "ActivationCheckpointing",
    "ActivationCompression",
    "ActivationOffload",
    "CostMonitor",
    "FitReport",
    "GPUMonitor",
    "MemoryBreakdown",
    "MemorySnapshot",
    "MicroBatchFinder",
    "NonFiniteGuard",
    "PrecisionReport",
    "ResumableCheckpoint",
    "SpeedMonitor",
    "StepTimer",
    "WarmupCosineLR",
]
