from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_trainopt.callbacks.speed_monitor import checkpointed_fraction
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.transforms.checkpointing import is_checkpointed
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._saved_probe import SavedProbe


class ForeignModule(pl.LightningModule):
    """Not written for us: torch's own encoder layers, a batch dict, no config attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True) for _ in range(3)
        )
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, callbacks: list[pl.Callback], steps: int = 1) -> SavedProbe:
    probe = SavedProbe()
    torch.manual_seed(0)
    tiny_trainer([*callbacks, probe], max_steps=steps).fit(module, datamodule=tiny_data(batch_size=4))
    return probe


def test_cuts_saved_bytes_on_litgpt_and_restores_module() -> None:
    base = _fit(tiny_module(), []).reports[0].activation_bytes
    callback = ActivationCheckpointing(module_classes=["Block"])
    module = tiny_module()
    ckpt = _fit(module, [callback]).reports[0].activation_bytes
    assert ckpt < 0.5 * base
    summary = callback.summary()["activation_checkpointing"]
    assert summary["wrapped"] == 2
    assert summary["candidates"] == 2
    assert 0 < summary["recomputed_fraction"] < 1
    assert callback.recomputed_fraction == summary["recomputed_fraction"]
    # teardown restored the module: a second fit without the callback saves as much as the baseline.
    assert not any(is_checkpointed(b) for b in module.gpt.blocks)


def test_foreign_module_default_policy_and_every_k() -> None:
    base = _fit(ForeignModule(), []).reports[0].activation_bytes
    half = ActivationCheckpointing(every_k=2)
    half_bytes = _fit(ForeignModule(), [half]).reports[0].activation_bytes
    full = ActivationCheckpointing(names=["layers.*"])
    full_bytes = _fit(ForeignModule(), [full]).reports[0].activation_bytes
    assert half.plan is not None
    assert half.plan.wrapped == ("layers.0", "layers.2")
    assert full.plan is not None
    assert full.plan.wrapped == ("layers.0", "layers.1", "layers.2")
    assert full_bytes < half_bytes < base


def test_speed_monitor_sees_the_wrapped_blocks() -> None:
    module = tiny_module()
    module.configure_model()
    callback = ActivationCheckpointing(every_k=2)
    callback.on_fit_start(None, module)  # type: ignore[arg-type]
    assert checkpointed_fraction(module, n_blocks=2) == 0.5


def test_survives_two_fits() -> None:
    callback = ActivationCheckpointing()
    module = tiny_module()
    first = _fit(module, [callback]).reports[0].activation_bytes
    second = _fit(module, [callback]).reports[0].activation_bytes
    assert first == second
    assert callback.state_dict() == {}


def test_bad_policy_raises_before_training() -> None:
    with pytest.raises(ConfigError, match=r"activations\.activation_checkpointing\.every_k"):
        ActivationCheckpointing(every_k=0)
    with pytest.raises(ConfigError, match="module_classes"):
        _fit(tiny_module(), [ActivationCheckpointing(module_classes=["Nope"])])


def test_a_module_that_checkpoints_itself_is_left_alone_with_a_warning() -> None:
    # Hugging Face's gradient_checkpointing_enable() sets gradient_checkpointing=True on the model and its layers;
    # wrapping again saved nothing and added a second recompute pass, silently.
    module = ForeignModule()
    module.layers[0].gradient_checkpointing = True
    callback = ActivationCheckpointing()
    with pytest.warns(UserWarning, match=r"wraps nothing.*\['layers\.0'\] already checkpoint themselves"):
        _fit(module, [callback])
    assert not any(is_checkpointed(layer) for layer in module.layers)
    summary = callback.summary()["activation_checkpointing"]
    assert summary["wrapped"] == 0
    assert summary["self_checkpointed"] == ["layers.0"]
    assert 0 < summary["recomputed_fraction"] <= 1
