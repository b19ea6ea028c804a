from __future__ import annotations

import pytest
import torch

from lightning_trainopt.callbacks.activation_compression import ActivationCompression
from lightning_trainopt.callbacks.activation_offload import ActivationOffload
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.metrics.saved_tensors import _STATE
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer
from tests.unit.callbacks._saved_probe import SavedProbe


def _fit(callbacks: list, steps: int = 2) -> SavedProbe:
    probe = SavedProbe()
    torch.manual_seed(0)
    tiny_trainer([*callbacks, probe], max_steps=steps).fit(tiny_module(), datamodule=tiny_data(batch_size=8))
    return probe


def test_int8_cuts_measured_bytes_and_uninstalls() -> None:
    base = _fit([]).reports[0]
    callback = ActivationCompression(min_numel=256)
    probe = _fit([callback])
    int8 = probe.reports[0]
    assert int8.by_dtype.get("int8", 0) > 0
    assert int8.activation_bytes < 0.55 * base.activation_bytes
    summary = callback.summary()["activation_compression"]
    assert summary["bits"] == 8
    assert summary["compressed_storages"] > 0
    # Nothing stays installed after fit.
    assert not _STATE.transforms
    assert not _STATE.counters


def test_survives_two_fits() -> None:
    callback = ActivationCompression(min_numel=256)
    first = _fit([callback], steps=1).reports[0].activation_bytes
    second = _fit([callback], steps=1).reports[0].activation_bytes
    assert first == second


def test_arguments_validated_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"activations\.activation_compression\.bits"):
        ActivationCompression(bits=4)
    with pytest.raises(ConfigError, match=r"activations\.activation_compression\.block_size"):
        ActivationCompression(block_size=0)


def test_refuses_offload_together() -> None:
    with pytest.raises(IncompatibleConfigError, match="activations=offload or activations=int8"):
        _fit([ActivationCompression(), ActivationOffload()], steps=1)
