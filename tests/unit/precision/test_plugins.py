import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, TrainOptFSDPStrategy, precision_needs
from lightning_trainopt.precision import PrecisionSpec, trainer_precision_kwargs

FP16_SCALED = PrecisionSpec(name="fp16", trainer_precision="16-mixed", init_scale=1024.0, growth_interval=7)


def test_plain_precisions_pass_the_string():
    bf16 = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed")
    assert trainer_precision_kwargs(bf16, precision_needs(DDPStrategy())) == {"precision": "bf16-mixed"}
    fp16 = PrecisionSpec(name="fp16", trainer_precision="16-mixed")
    assert trainer_precision_kwargs(fp16, precision_needs(DDPStrategy())) == {"precision": "16-mixed"}


@pytest.fixture
def cuda_scaler(monkeypatch):
    """GradScaler("cuda") disables itself (and keeps no settings) where CUDA is absent; pretend it is there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_fp16_loss_scaler_settings_reach_the_scaler(cuda_scaler):
    (plugin,) = trainer_precision_kwargs(FP16_SCALED, precision_needs(DDPStrategy()))["plugins"]
    assert type(plugin) is MixedPrecision
    assert plugin.scaler._init_scale == 1024.0
    assert plugin.scaler._growth_interval == 7


def test_fp16_under_fsdp1_gets_the_sharded_scaler(cuda_scaler):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    (plugin,) = trainer_precision_kwargs(FP16_SCALED, precision_needs(FSDPStrategy()))["plugins"]
    assert isinstance(plugin, FSDPPrecision)
    assert isinstance(plugin.scaler, ShardedGradScaler)
    assert (plugin.scaler._init_scale, plugin.scaler._growth_interval) == (1024.0, 7)


def test_deepspeed_keeps_its_own_scaler():
    assert trainer_precision_kwargs(FP16_SCALED, precision_needs(TrainOptDeepSpeedStrategy(stage=2))) == {
        "precision": "16-mixed"
    }


@pytest.mark.parametrize("spec", [FP16_SCALED, PrecisionSpec(name="fp16", trainer_precision="16-mixed")])
def test_fp16_under_fsdp2_is_refused_even_with_a_custom_scaler(spec):
    with pytest.raises(IncompatibleConfigError, match="bf16"):
        trainer_precision_kwargs(spec, precision_needs(TrainOptFSDPStrategy()))


def test_a_built_strategy_or_its_name_is_answered_as_before():
    # The earlier form, trainer_precision_kwargs(spec, strategy) (bench/planner_states.py, users' own scripts):
    # parallel/ answers the strategy, so the result is the same as with its precision_needs.
    from lightning.pytorch.strategies import DeepSpeedStrategy

    assert trainer_precision_kwargs(FP16_SCALED, DeepSpeedStrategy(stage=2)) == trainer_precision_kwargs(
        FP16_SCALED, precision_needs(DeepSpeedStrategy(stage=2))
    )
    assert trainer_precision_kwargs(FP16_SCALED, DeepSpeedStrategy(stage=2)) == {"precision": "16-mixed"}
    with pytest.raises(IncompatibleConfigError):
        trainer_precision_kwargs(FP16_SCALED, TrainOptFSDPStrategy())
    bf16 = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed")
    assert trainer_precision_kwargs(bf16, "auto") == {"precision": "bf16-mixed"}
