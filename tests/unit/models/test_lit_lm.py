"""The shared language-model loop: val_loss is the mean over validation tokens, val_ppl its exponential."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.tiny_fit import tiny_module


def test_val_loss_weights_each_batch_by_its_tokens():
    # 5 rows in batches of 3: the last batch has 2 rows, so a mean of batch means would weigh its rows 1.5 times.
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (5, 9))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=3)
    module = tiny_module()
    module.configure_model()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    logged = trainer.validate(module, data, verbose=False)[0]
    with torch.no_grad():
        losses = [module.batch_loss((x, y)) for x, y in data]
    per_token = sum(float(loss) * n for loss, n in losses) / sum(n for _, n in losses)
    batch_mean = sum(float(loss) for loss, _ in losses) / len(losses)
    assert abs(per_token - batch_mean) > 1e-4  # the case distinguishes the two means
    assert math.isclose(logged["val_loss"], per_token, rel_tol=1e-6)
    assert math.isclose(logged["val_ppl"], math.exp(per_token), rel_tol=1e-6)
