"""StepTimer's exposed-communication probe under DDP on 2 CPU (gloo) processes; one fit per setup, same processes.

Usage: python tests/integration/_step_timer_ddp_script.py OUT_DIR [SETUP,SETUP,...]
Setups: ``comm`` (many parameters, almost no compute), ``compute`` (few parameters, much compute, gradient
accumulation 2), ``user_hook`` (the strategy registers its own DDP hook, which StepTimer must leave alone); on one
CUDA device ``gpu_comm`` and ``gpu_user_hook`` (Lightning registers ``ddp_comm_hook`` on CUDA).
Each rank writes OUT_DIR/rank{r}.json: ``{setup: {"summary": ..., "grads_ready": marks taken, "global_step": ...,
"user_hook_calls": ...}}``.

On CPU StepTimer reads a fake clock that only the run's own events move, by the amounts in ``PHASES``: the dataset's
``__getitem__`` (data wait), a callback ahead of StepTimer at ``on_before_backward`` (forward) and
``on_before_optimizer_step`` (optimizer), and the probe's mark itself (``backward`` just before it, ``comm`` just
after it, so only a backward that really hands gradients to the reduction has either). Every phase is then an exact
number of fake seconds, whatever the machine's load, and the split must equal it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_trainopt.callbacks import StepTimer  # noqa: E402
from lightning_trainopt.launch.multirun import teardown_distributed  # noqa: E402
from tests.helpers.tiny_fit import tiny_trainer  # noqa: E402

# name -> (width, layers, micro-batch rows, accumulate_grad_batches, DDPStrategy kwargs). On CPU the phases' lengths
# come from PHASES; the setups give the probe its cases:
# "comm": all gradients in one bucket (grads as bucket views, bucket_cap_mb above the model).
# "compute": 4 x 256^2 x 4 B = 1 MiB in four buckets of one layer (0.25 MiB) each, accumulation 2 (each step's first
# micro-batch runs under no_sync, reducing nothing): one mark per reducing backward, from the last bucket.
# "user_hook": the strategy's own hook, which the probe leaves alone.
SETUPS: dict[str, tuple[int, int, int, int, dict[str, Any]]] = {
    "comm": (256, 4, 8, 1, {"gradient_as_bucket_view": True, "bucket_cap_mb": 100}),
    "compute": (256, 4, 64, 2, {"bucket_cap_mb": 0.2}),
    "user_hook": (128, 4, 64, 1, {}),
    # One CUDA device, DDP over NCCL (world size 1): the CUDA-event path of the probe, and a hook Lightning registers.
    "gpu_comm": (1024, 16, 1, 1, {"gradient_as_bucket_view": True, "bucket_cap_mb": 100}),
    "gpu_user_hook": (1024, 16, 1, 1, {"ddp_comm_hook": default_hooks.fp16_compress_hook}),
}
MAX_STEPS = 10


@dataclass(frozen=True)
class Phases:
    """Fake seconds the clock moves: per micro-batch ``data`` and ``forward``, per reducing backward ``backward`` and
    ``comm``, per optimizer step ``optimizer``."""

    data: float
    forward: float
    backward: float
    comm: float
    optimizer: float


# Powers of two (sums of them), so the fractions are exact in binary floating point.
PHASES = {
    "comm": Phases(data=1, forward=2, backward=3, comm=8, optimizer=2),  # 16 per step
    "compute": Phases(data=1, forward=6, backward=15, comm=1, optimizer=2),  # 2 micro-batches: 32 per step
    "user_hook": Phases(data=1, forward=5, backward=0, comm=0, optimizer=2),  # no probe, no mark: 8 per step
}


class FakeClock:
    """Seconds that pass only when :meth:`advance` is called."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


CLOCK = FakeClock()


class SameBatch(Dataset):
    """``length`` copies of one pre-built micro-batch: no per-row collation, no memory per item."""

    def __init__(self, batch: torch.Tensor, length: int, fetch_s: float = 0.0) -> None:
        self.batch, self.length, self.fetch_s = batch, length, fetch_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        CLOCK.advance(self.fetch_s)  # inside the loop's timed fetch (num_workers=0: this process)
        return (self.batch,)


class Stack(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Plain SGD: the cheapest real step (the phases' lengths come from the fake clock).
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class CountingTimer(StepTimer):
    """StepTimer that also counts the probe's marks (one per reducing backward) and DDP's buckets, and moves the fake
    clock by the backward's and the reduction's seconds around its mark."""

    def __init__(self, phases: Phases | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.phases = phases or Phases(0, 0, 0, 0, 0)
        self.grads_ready = 0
        self.num_buckets = 0

    def _grads_ready(self) -> None:
        self.grads_ready += 1
        CLOCK.advance(self.phases.backward)
        super()._grads_ready()
        CLOCK.advance(self.phases.comm)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # Private DDP logging data, read only to check that the compute setup really has several buckets.
        rebuilt = trainer.strategy.model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
        self.num_buckets = len(rebuilt.split(",")) if rebuilt else 0


class AdvanceClock(pl.Callback):
    """Placed ahead of StepTimer: moves the fake clock by the forward's seconds before StepTimer's ``before_backward``
    mark and by the optimizer's before its ``before_optimizer_step`` mark."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        CLOCK.advance(self.phases.forward)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        CLOCK.advance(self.phases.optimizer)


class UserHookDDP(DDPStrategy):
    """Registers a user hook on CPU too (Lightning's DDPStrategy registers ``ddp_comm_hook`` on CUDA only)."""

    calls = 0

    def configure_ddp(self) -> None:
        super().configure_ddp()

        # Unannotated: with `from __future__ import annotations` DDP's hook check rejects the string annotations.
        def user_hook(state, bucket):  # type: ignore[no-untyped-def]
            UserHookDDP.calls += 1
            return default_hooks.allreduce_hook(state, bucket)

        self.model.register_comm_hook(None, user_hook)


def run(setup: str) -> dict[str, Any]:
    width, layers, batch, accumulate, ddp_kwargs = SETUPS[setup]
    torch.manual_seed(0)
    on_gpu = setup.startswith("gpu_")
    phases = PHASES.get(setup)  # CUDA setups time with CUDA events, which no fake clock moves
    # Pre-built micro-batches (DataLoader(batch_size=None)): no per-row collation.
    data = SameBatch(torch.randn(batch, width), MAX_STEPS * accumulate * 2, phases.data if phases else 0.0)
    timer = CountingTimer(phases, warmup_steps=1, log_every_n_steps=2, clock=CLOCK if phases else None)
    strategy = UserHookDDP(**ddp_kwargs) if setup == "user_hook" else DDPStrategy(**ddp_kwargs)
    trainer = tiny_trainer(
        [AdvanceClock(phases), timer] if phases else [timer],
        max_steps=MAX_STEPS,
        accelerator="gpu" if on_gpu else "cpu",
        devices=1 if on_gpu else 2,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(Stack(width, layers), DataLoader(data, batch_size=None))
    return {
        "num_buckets": timer.num_buckets,
        "summary": timer.summary()["step_time"],
        "grads_ready": timer.grads_ready,
        "global_step": trainer.global_step,
        "user_hook_calls": UserHookDDP.calls,
        "rank": trainer.global_rank,
    }


def main(out: str, setups: list[str]) -> None:
    warnings.simplefilter("ignore")
    results = {setup: run(setup) for setup in setups}
    rank = results[setups[0]]["rank"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    # Lightning leaves the gloo group up; exiting with it alive can abort ("terminate called without an active
    # exception") while gloo's threads are torn down.
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ["comm", "compute", "user_hook"])
