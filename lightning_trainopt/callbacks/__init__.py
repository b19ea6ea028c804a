"""Callbacks that measure and guard training; each is a thin adapter over ``lightning_trainopt.core``."""

from lightning_trainopt.callbacks.cost_monitor import CostMonitor
from lightning_trainopt.callbacks.gpu_monitor import GPUMonitor
from lightning_trainopt.callbacks.memory_breakdown import MemoryBreakdown
from lightning_trainopt.callbacks.memory_snapshot import MemorySnapshot
from lightning_trainopt.callbacks.non_finite_guard import NonFiniteGuard
from lightning_trainopt.callbacks.speed_monitor import SpeedMonitor
from lightning_trainopt.callbacks.step_timer import StepTimer
from lightning_trainopt.callbacks.warmup_cosine_lr import WarmupCosineLR

__all__ = [
    "CostMonitor",
    "GPUMonitor",
    "MemoryBreakdown",
    "MemorySnapshot",
    "NonFiniteGuard",
    "SpeedMonitor",
    "StepTimer",
    "WarmupCosineLR",
]
