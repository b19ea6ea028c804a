"""DeepSpeed's CPU Adam in place of the user's AdamW (optimizer offload).

Moved out of the unit tests: building ``DeepSpeedCPUAdam`` compiles DeepSpeed's ``cpu_adam`` C++ op on first use (about
50 s on the 2-core development machine when torch's extension cache is cold; cached afterwards).
"""

from __future__ import annotations

import pytest
import torch

from lightning_trainopt.parallel import to_deepspeed_cpu_adam
from tests.helpers.runif import RunIf


@pytest.mark.slow
@RunIf(deepspeed=True)
def test_cpu_adam_replaces_adamw_with_same_settings():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)
    new = to_deepspeed_cpu_adam(opt)
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert isinstance(new, DeepSpeedCPUAdam)
    assert new.adam_w_mode
    assert [len(g["params"]) for g in new.param_groups] == [len(g["params"]) for g in opt.param_groups]
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 1e-3 and tuple(g["betas"]) == (0.8, 0.95) and g["eps"] == 1e-7 for g in new.param_groups)
