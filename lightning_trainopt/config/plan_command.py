"""What the planner reads of the composed config and of Hydra: preset names, the run's overrides, the train command
it prints, and the exit status of a ``plan.py -m`` sweep.

Here in ``config/`` so that ``planner/`` stays pure (no Hydra, no OmegaConf): the planner's report takes the values
these functions read.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.planner.report import refused_jobs
from lightning_trainopt.planner.search import TP_STRATEGY

if TYPE_CHECKING:
    from lightning_trainopt.planner import PlanInputs

__all__ = ["PlanSweepCheck", "override_keys", "plan_choices", "train_command"]


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def plan_choices(cfg: DictConfig) -> dict[str, str]:
    """Preset names of the composed config (Hydra's runtime choices when running under ``@hydra.main``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        runtime = dict(HydraConfig.get().runtime.choices)
    except ValueError:
        runtime = {}
    plan_cfg = cfg.get("plan") or {}
    given = dict(_plain(plan_cfg.get("choices")) or {})
    out = {}
    for group in ("model", "precision", "strategy", "activations", "optimizer", "hardware"):
        name = given.get(group) or runtime.get(group)
        if name is None and group in ("model", "precision", "strategy") and cfg.get(group) is not None:
            node = cfg[group]
            name = node.get("preset" if group == "strategy" else "name")
            if name is None and group == "strategy":  # ddp: DDPStrategy takes no preset, so it goes by its class
                name = str(node.get("_target_", "")).rsplit(".", 1)[-1].removesuffix("Strategy").lower()
        if name is not None and str(name) not in ("null", "None"):
            out[group] = str(name)
    return out


# Overrides the planner writes itself in the printed command, from the planned values.
_PLANNED_KEYS = (
    "trainer.devices",
    "trainer.num_nodes",
    "data.batch_size",
    "data.seq_len",
    "trainer.accumulate_grad_batches",
    "strategy.tensor_parallel_size",
    "strategy.replicate",
)


def _task_overrides(cfg: DictConfig) -> list[str]:
    """The command-line overrides of this run: ``plan.overrides`` when an API caller gives them, else Hydra's."""
    given = _plain((cfg.get("plan") or {}).get("overrides"))
    if given:
        return [str(o) for o in given]
    try:
        from hydra.core.hydra_config import HydraConfig

        return [str(o) for o in HydraConfig.get().overrides.task]
    except ValueError:
        return []


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def override_keys(cfg: DictConfig) -> set[str]:
    """The keys this run's overrides set (``data.seq_len``, ``model``, ...), without ``+``/``~``."""
    return {_override_key(o) for o in _task_overrides(cfg)}


def train_command(
    cfg: DictConfig, choices: dict[str, str], inputs: PlanInputs, swapped: dict[str, str] | None = None
) -> str:
    """``python train.py`` + the user's overrides (so the same model, data and hardware compose) + the planned values.

    Args:
        cfg: the composed config.
        choices: preset names of the planned configuration (a search winner's groups included).
        inputs: the planned values (devices, micro-batch, sequence length, accumulation).
        swapped: groups a search winner replaces (group -> new preset): the user's override of the group and of
            its keys are dropped, the winner's preset is written instead.
    """
    swapped = swapped or {}
    # Run as trainopt-plan (an installed wheel, no train.py at hand): the command is trainopt-train.
    parts = ["trainopt-train" if Path(sys.argv[0]).name == "trainopt-plan" else "python train.py"]
    given = _task_overrides(cfg)
    for o in given:
        key = _override_key(o)
        group = key.split(".", 1)[0]
        if group in ("plan", "hydra") or key in _PLANNED_KEYS or group in swapped:
            continue
        parts.append(o)
    present = {_override_key(o).split(".", 1)[0] for o in parts[1:] if "." not in _override_key(o)}
    for group in ("model", "hardware", "precision", "activations", "optimizer"):
        if group in choices and (group in swapped or group not in present):
            parts.append(f"{group}={choices[group]}")
    if "loss" in swapped:  # only a search that chose the loss writes it (the config's own is in the overrides)
        parts.append(f"loss={swapped['loss']}")
    if "adapter" in swapped:  # likewise the adapter (plan.adapters=true)
        parts.append(f"adapter={swapped['adapter']}")
    strategy_given = "strategy" in present and "strategy" not in swapped
    # A strategy the overrides did not give came from a defaults list (an experiment preset such as qlora_70b, or a
    # ladder rung): `+strategy=` would then fail to compose ("an item is already at 'strategy'"). The preset's own
    # composes again without a word; a search winner's replaces it with `strategy=`.
    from_defaults = cfg.get("strategy") is not None and "strategy" not in {_override_key(o) for o in given}
    if from_defaults and "strategy" in swapped:
        parts.append(f"strategy={choices['strategy']}")
    elif choices.get("strategy") and inputs.layout.has_strategy and not strategy_given and not from_defaults:
        parts.append(f"+strategy={choices['strategy']}")
    parts += [
        f"trainer.devices={inputs.devices}",
        f"data.batch_size={inputs.micro_batch}",
        f"data.seq_len={inputs.seq_len}",
        f"trainer.accumulate_grad_batches={inputs.accumulate}",
    ]
    if inputs.num_nodes > 1:
        parts.append(f"trainer.num_nodes={inputs.num_nodes}")
    # The planned sizes replace the user's (dropped above with the other planned keys); ++ adds or overrides. The
    # fsdp_tp strategy gets both; another one only a size above 1 (FSDP2's own class takes no `replicate`).
    tp_strategy = choices.get("strategy") == TP_STRATEGY
    if inputs.tensor_parallel > 1 or tp_strategy:
        parts.append(f"++strategy.tensor_parallel_size={inputs.tensor_parallel}")
    if inputs.replicate > 1 or tp_strategy:
        parts.append(f"++strategy.replicate={inputs.replicate}")
    return " ".join([parts[0], *_config_dirs(), *parts[1:]])


def _config_dirs() -> list[str]:
    """The user's config directories (``--config-dir``, ``hydra.searchpath``), so the command finds their presets."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hydra_cfg = HydraConfig.get()
    except ValueError:
        return []
    dirs = [
        f"--config-dir {shlex.quote(s.path)}" for s in hydra_cfg.runtime.config_sources if s.provider == "command-line"
    ]
    return dirs + [
        shlex.quote(str(o)) for o in hydra_cfg.overrides.hydra if _override_key(str(o)) == "hydra.searchpath"
    ]


class PlanSweepCheck(Callback):
    """Hydra callback of ``plan.py -m``: list the refused jobs at the end; exit with code 2 when every job was.

    Each refused job is reported as it happens and the sweep goes on; at its end the refusals are listed again, and
    a sweep in which no job was planned exits 2, as ``train.py -m`` does when no job succeeded (Hydra does not see
    a refusal as a failure). Registered in ``conf/plan.yaml``::

        hydra:
          callbacks:
            plan_sweep:
              _target_: lightning_trainopt.config.plan_command.PlanSweepCheck
    """

    def __init__(self) -> None:
        self.jobs = 0

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        self.jobs += 1

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        refused = refused_jobs(sweep_dir) if sweep_dir.is_dir() else {}
        if not refused:
            return
        for job, error in refused.items():
            print(f"error: job {job} {error}", file=sys.stderr)
        tally = f"{len(refused)} of {self.jobs} plan job(s) of {sweep_dir}"
        print(f"error: {tally} not planned; see above.", file=sys.stderr)
        if len(refused) >= self.jobs:
            # Hydra turns a callback's exception into a warning; SystemExit passes its handler and sets the status.
            raise SystemExit(2)
