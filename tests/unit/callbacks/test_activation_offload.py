from __future__ import annotations

import pytest
import torch

from lightning_trainopt.callbacks.activation_offload import ActivationOffload
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import _STATE, SavedTensorsCounter, transform_saved_tensors
from lightning_trainopt.transforms.offload import CpuOffloader
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer


def test_on_cpu_it_says_so_and_changes_nothing() -> None:
    callback = ActivationOffload()
    trainer = tiny_trainer([callback], max_steps=1)
    with pytest.warns(UserWarning, match="ActivationOffload is off"):
        trainer.fit(tiny_module(), datamodule=tiny_data())
    assert callback.enabled is False
    assert callback.summary()["activation_offload"]["offloaded_tensors"] == 0
    assert not _STATE.transforms


def test_cpu_tensors_pass_through() -> None:
    offloader = CpuOffloader(pin_memory=False)
    x = torch.randn(64, 64, requires_grad=True)
    with SavedTensorsCounter() as counter, transform_saved_tensors(offloader):
        y = torch.sin(x)
    y.sum().backward()
    assert offloader.n_offloaded == 0
    assert offloader.n_passed == 1
    assert counter.report().by_device == {"cpu": 64 * 64 * 4}


def test_arguments_validated() -> None:
    with pytest.raises(ConfigError, match=r"activations\.activation_offload\.min_numel"):
        ActivationOffload(min_numel=0)


@RunIf(min_cuda_gpus=1)
def test_cuda_activations_move_to_pinned_cpu_and_back() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    lin(x).pow(2).mean().backward()
    ref = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad()
    offloader = CpuOffloader()
    with SavedTensorsCounter() as counter, transform_saved_tensors(offloader):
        loss = lin(x).pow(2).mean()
    report = counter.report()
    assert report.device_bytes("cuda") == 0
    assert report.device_bytes("cpu") > 0
    assert offloader.n_offloaded > 0
    loss.backward()
    for g, r in zip((p.grad for p in lin.parameters()), ref, strict=True):
        torch.testing.assert_close(g, r)
