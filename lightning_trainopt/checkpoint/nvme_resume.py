"""Resume under ZeRO-Infinity's NVMe optimizer offload: restore what DeepSpeed's checkpoint loader leaves out.

Relies on DeepSpeed 0.19's ZeRO-3 internals: its private methods through ``_compat.deepspeed_internals``, and the
public attributes ``fp32_partitioned_groups_flat``, the optimizer swapper's ``swap_params_info`` and swap-file
naming. ``tests/integration/test_strategies_nvme.py`` checks the resumed loss trajectory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_trainopt._compat.deepspeed_internals import (
    fp32_param_groups_set,
    refresh_partitioned_parameters,
    swappable_subgroup,
    zero_checkpoint_name,
)

__all__ = ["restore_nvme_optimizer_state"]


def restore_nvme_optimizer_state(engine: Any, checkpoint_dir: str) -> None:
    """Restore the Adam moments, step and group settings that DeepSpeed's loader drops under NVMe optimizer offload.

    With ``offload_optimizer.device=nvme`` DeepSpeed (0.19) copies the checkpoint's ``offloaded_tensors`` (fp32
    master, ``exp_avg``, ``exp_avg_sq`` swap files) into the swap folder but never reads the rank's
    ``optim_states.pt`` (``engine.load_checkpoint`` skips ``_load_zero_checkpoint`` when
    ``zero_nvme_offload_optimizer()``). The optimizer state therefore stays empty, and the first step after the
    resume creates zero moments at step 1: only the master weights survive (measured: step 5's loss after a resume
    at step 3 was off by 4.4e-3). This reads that file and puts back the param-group settings (lr, betas, ...), the
    loss scaler, every scalar of the state (``step``) and the moment tensors: from the file itself when small
    tensors were kept in it, else from their swap files (``{state}-{ds_id}.tensor.swp``). DeepSpeed's swapper then
    registers the restored tensors and swaps them out after the next step, as it does for a running job.

    Args:
        engine: the DeepSpeed engine, after ``engine.load_checkpoint``.
        checkpoint_dir: the checkpoint directory that was loaded.
    """
    zero_optimizer = engine.optimizer
    swapper = zero_optimizer.optimizer_swapper
    tag = Path(checkpoint_dir, "latest").read_text().strip()
    saved = torch.load(zero_checkpoint_name(engine, checkpoint_dir, tag), map_location="cpu", weights_only=False)
    saved = saved["optimizer_state_dict"]
    zero_optimizer.loss_scaler = saved["loss_scaler"]
    zero_optimizer.dynamic_loss_scale = saved["dynamic_loss_scale"]
    zero_optimizer.overflow = saved["overflow"]
    inner, inner_saved = zero_optimizer.optimizer, saved["optimizer_state_dict"]
    # DeepSpeed fills the inner optimizer's groups with the fp32 partitions only around (de)serialisation.
    with fp32_param_groups_set(zero_optimizer):
        for group, group_saved in zip(inner.param_groups, inner_saved["param_groups"], strict=True):
            group.update({k: v for k, v in group_saved.items() if k != "params"})
            for param, index in zip(group["params"], group_saved["params"], strict=True):
                state = inner.state[param]
                for key, value in inner_saved["state"].get(index, {}).items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() > 0:
                        # Scalars, and tensors DeepSpeed kept in memory (too small to swap): in the file itself.
                        state[key] = value
                        continue
                    # An empty placeholder: the tensor was swapped out, its bytes are in the swap file. Parameters
                    # whose state DeepSpeed kept in memory have no swap entry, so look it up only here.
                    info = swapper.swap_params_info.get(param.ds_id)
                    path = os.path.join(swapper.swap_folder, f"{key}-{param.ds_id}.tensor.swp")
                    if info is None or not os.path.isfile(path):
                        raise RuntimeError(
                            f"NVMe resume: optimizer state {key!r} of parameter {param.ds_id} was swapped out when "
                            f"{checkpoint_dir} was saved, but {path} is missing; resume from a checkpoint whose "
                            "offloaded_tensors folder is complete."
                        )
                    state[key] = torch.from_file(path, shared=False, size=info.numel(), dtype=info.tensor_dtype)
    _restore_in_memory_masters(zero_optimizer, saved["fp32_flat_groups"])
    rank_zero_info(
        f"NVMe optimizer offload: restored Adam's moments and step ({_steps(inner)}), the param-group settings and "
        f"the loss scale from {checkpoint_dir} (DeepSpeed restores only the fp32 master weights)."
    )


def _restore_in_memory_masters(zero_optimizer: Any, saved_flat_groups: list[torch.Tensor]) -> None:
    """Put back the fp32 master partitions of sub-groups too small to swap, and the weights computed from them.

    A sub-group under DeepSpeed's minimum swap size (e.g. the no-decay group of norm vectors) keeps its fp32 master
    in memory; DeepSpeed's NVMe load path skips ``_load_zero_checkpoint``, so that master would stay at its fresh
    initialisation and ``reset_swap_buffers`` would copy it into the half/fp32 working weights. This copies the saved
    master in, refreshes that sub-group's working partitions from it, and re-gathers the persistent parameters
    (a collective: every rank runs it).
    """
    in_memory = [i for i in range(len(saved_flat_groups)) if not swappable_subgroup(zero_optimizer, i)]
    if not in_memory:
        return  # every master came back with the swap files
    # Free the gathered copies of persistent parameters first, so that the gather below reads the new partitions.
    zero_optimizer.checkpoint_event_prologue()
    for i in in_memory:
        saved_flat = saved_flat_groups[i]
        current = zero_optimizer.fp32_partitioned_groups_flat[i]
        if saved_flat.numel() != current.numel():
            raise RuntimeError(
                f"NVMe resume: in-memory fp32 sub-group {i} has {current.numel()} elements, the checkpoint "
                f"{saved_flat.numel()}; resume with the same model, world size and sub_group_size."
            )
        current.data.copy_(saved_flat.data)
        refresh_partitioned_parameters(zero_optimizer, i)
    zero_optimizer.checkpoint_event_epilogue()


def _steps(optimizer: Optimizer) -> str:
    steps = {int(state["step"]) for state in optimizer.state.values() if "step" in state}
    return ", ".join(map(str, sorted(steps))) or "none"
