import json

import pytest
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf

from lightning_trainopt.config.strategy import build_strategy
from lightning_trainopt.config.tree import CONF_DIR
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.parallel import TrainOptDeepSpeedStrategy, preset_name
from lightning_trainopt.precision import PrecisionSpec

BF16 = PrecisionSpec(name="bf16", trainer_precision="bf16-mixed")
FP16 = PrecisionSpec(name="fp16", trainer_precision="16-mixed", init_scale=65536.0, growth_interval=2000)
TRAINER = {"accumulate_grad_batches": 1, "gradient_clip_val": 1.0}


def preset(name):
    return OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml")


def test_none_is_auto():
    assert build_strategy(None, BF16, TRAINER) == "auto"


def test_ddp_preset():
    s = build_strategy(preset("ddp"), BF16, TRAINER, micro_batch_size=8)
    assert isinstance(s, DDPStrategy)
    assert preset_name(s) == "ddp"


@pytest.mark.parametrize(("name", "stage"), [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero3_offload", 3)])
def test_zero_presets_map_stage_micro_batch_and_name(name, stage):
    s = build_strategy(preset(name), BF16, TRAINER, micro_batch_size=8)
    assert isinstance(s, TrainOptDeepSpeedStrategy)
    assert s.zero_stage == stage
    assert s.config["train_micro_batch_size_per_gpu"] == 8
    assert preset_name(s) == name


def test_zero3_persistence_threshold_is_ours():
    s = build_strategy(preset("zero3"), BF16, TRAINER, micro_batch_size=2)
    assert s.config["zero_optimization"]["stage3_param_persistence_threshold"] == 10_000


def test_offload_presets_report_devices():
    assert build_strategy(preset("zero2_offload"), BF16, TRAINER).offload_devices() == {
        "optimizer": "cpu",
        "param": "none",
    }
    assert build_strategy(preset("zero3_offload"), BF16, TRAINER).offload_devices() == {
        "optimizer": "cpu",
        "param": "cpu",
    }
    assert build_strategy(preset("zero_infinity"), BF16, TRAINER).offload_devices() == {
        "optimizer": "nvme",
        "param": "nvme",
    }


def test_fp16_loss_scaling_maps_to_deepspeed():
    s = build_strategy(preset("zero2"), FP16, TRAINER, micro_batch_size=4)
    assert s.initial_scale_power == 16
    assert s.loss_scale_window == 2000


def test_fp16_init_scale_not_power_of_two_is_refused():
    spec = PrecisionSpec(name="fp16", trainer_precision="16-mixed", init_scale=1000.0)
    with pytest.raises(ConfigError, match="precision.init_scale"):
        build_strategy(preset("zero2"), spec, TRAINER)


def test_clip_by_value_refused_for_deepspeed():
    with pytest.raises(ConfigError, match="gradient_clip_algorithm"):
        build_strategy(preset("zero1"), BF16, {**TRAINER, "gradient_clip_algorithm": "value"})


def test_missing_target_and_bad_micro_batch():
    with pytest.raises(ConfigError, match="strategy._target_"):
        build_strategy({"name": "x"}, BF16, TRAINER)
    with pytest.raises(ConfigError, match="data.batch_size"):
        build_strategy(preset("zero1"), BF16, TRAINER, micro_batch_size=0)


def test_deepspeed_json_file_accepted_as_is(tmp_path):
    user = {
        "train_batch_size": 1024,
        "optimizer": {"type": "AdamW", "params": {"lr": 6e-5}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(user))
    cfg = preset("deepspeed_json")
    cfg.config = str(path)
    s = build_strategy(cfg, BF16, TRAINER, micro_batch_size=8)
    assert s.zero_stage == 3
    assert s.config["train_batch_size"] == 1024
    assert s.config["optimizer"] == user["optimizer"]
    assert s.config["train_micro_batch_size_per_gpu"] == 8
    assert s.offload_devices()["optimizer"] == "cpu"
    assert json.loads(path.read_text()) == user  # the user's file is not rewritten


def test_deepspeed_json_missing_file():
    cfg = preset("deepspeed_json")
    cfg.config = "/nonexistent/ds.json"
    with pytest.raises(ConfigError, match="strategy.config"):
        build_strategy(cfg, BF16, TRAINER, micro_batch_size=8)


def test_deepspeed_json_without_path_names_the_key():
    with pytest.raises(ConfigError, match="strategy.config"):
        build_strategy(preset("deepspeed_json"), BF16, TRAINER, micro_batch_size=8)


def test_ddp_preset_saves_atomically(tmp_path, monkeypatch):
    import torch

    from lightning_trainopt.parallel import AtomicCheckpointIO

    s = build_strategy(preset("ddp"), BF16, TRAINER)
    assert isinstance(s.checkpoint_io, AtomicCheckpointIO)
    target = tmp_path / "last.ckpt"
    s.checkpoint_io.save_checkpoint({"w": 1}, target)
    assert torch.load(target)["w"] == 1

    def dying_save(checkpoint, f):
        f.write(b"half")  # the process dies after writing half of the file
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        s.checkpoint_io.save_checkpoint({"w": 2}, target)
    monkeypatch.undo()
    assert torch.load(target)["w"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_missing_deepspeed_names_the_extra(monkeypatch):
    import sys

    from omegaconf import OmegaConf

    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.exceptions import MissingDependencyError
    from lightning_trainopt.precision import PrecisionSpec

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed now raises ImportError
    node = OmegaConf.load(CONF_DIR / "strategy" / "zero3.yaml")
    with pytest.raises(MissingDependencyError, match=r"pip install torch==[0-9.]+ -e \"\.\[deepspeed\]\""):
        build_strategy(node, PrecisionSpec(name="fp32", trainer_precision="32-true"), None, micro_batch_size=4)


def test_a_strategy_without_a_preset_is_named_as_metrics_json_documents():
    from lightning.pytorch.strategies import SingleDeviceStrategy

    assert preset_name(SingleDeviceStrategy(device="cpu")) == "singledevice"
