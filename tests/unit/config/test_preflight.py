from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.config import preflight as pf
from lightning_trainopt.config.preflight import (
    RULES,
    PreflightInput,
    compatibility_matrix_markdown,
    preflight,
    preflight_from_cfg,
    size_advice,
)
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.parallel.compat_table import ADAPTER_TABLE, TABLE
from lightning_trainopt.parallel.spec import parse_strategy


def preset(name):
    return OmegaConf.to_container(OmegaConf.load(f"lightning_trainopt/conf/strategy/{name}.yaml"))


def test_plain_bf16_zero2_passes():
    assert (
        preflight(PreflightInput(strategy=parse_strategy(preset("zero2")), precision="bf16-mixed", accelerator="cpu"))
        == []
    )


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp"])
def test_fp8_with_sharding_refused(name):
    with pytest.raises(IncompatibleConfigError, match="18820"):
        preflight(
            PreflightInput(strategy=parse_strategy(preset(name)), precision="transformer-engine", accelerator="gpu")
        )


def test_fp8_refusal_matches_lightning_behaviour():
    # The rule mirrors what Lightning itself does when handed the combination.
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    with pytest.raises(ValueError, match="not supported"):
        DeepSpeedPrecision("transformer-engine")


def test_fp8_with_ddp_allowed():
    # Allowed, and without advice: Lightning's own FP8 plugin works with DDP.
    ddp = parse_strategy(preset("ddp"))
    assert preflight(PreflightInput(strategy=ddp, precision="transformer-engine", accelerator="gpu")) == []
    with pytest.raises(IncompatibleConfigError, match="18679"):  # not with DeepSpeed (Lightning #18679)
        preflight(
            PreflightInput(strategy=parse_strategy(preset("zero2")), precision="transformer-engine", accelerator="gpu")
        )


@pytest.mark.parametrize("name", ["zero2_offload", "zero3_offload"])
def test_8bit_optimizer_with_offload_refused(name):
    with pytest.raises(IncompatibleConfigError, match="6666"):
        preflight(
            PreflightInput(
                strategy=parse_strategy(preset(name)),
                optimizer_target="bitsandbytes.optim.AdamW8bit",
                accelerator="cpu",
            )
        )


def test_8bit_optimizer_with_fsdp_refused_but_kept_under_zero():
    with pytest.raises(IncompatibleConfigError, match="DTensor"):
        preflight(
            PreflightInput(
                strategy=parse_strategy(preset("fsdp")),
                optimizer_target="bitsandbytes.optim.AdamW8bit",
                accelerator="cpu",
            )
        )
    for name in ("zero1", "zero2", "zero3"):
        preflight(
            PreflightInput(
                strategy=parse_strategy(preset(name)),
                optimizer_target="bitsandbytes.optim.AdamW8bit",
                accelerator="cpu",
            )
        )


def test_non_adam_with_offload_refused_and_adam_allowed():
    with pytest.raises(IncompatibleConfigError, match="ZeRORuntimeException"):
        preflight(
            PreflightInput(
                strategy=parse_strategy(preset("zero2_offload")), optimizer_target="torch.optim.SGD", accelerator="cpu"
            )
        )
    preflight(
        PreflightInput(
            strategy=parse_strategy(preset("zero2_offload")), optimizer_target="torch.optim.AdamW", accelerator="cpu"
        )
    )


def test_deepspeed_json_with_its_own_optimizer_and_offload_allowed():
    strategy = {
        **preset("deepspeed_json"),
        "config": {
            "optimizer": {"type": "AdamW", "params": {"lr": 6e-5}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        },
    }
    # The JSON's own AdamW is what DeepSpeed offloads, so the app's SGD does not matter: allowed, no advice.
    spec = parse_strategy(strategy)
    assert preflight(PreflightInput(strategy=spec, optimizer_target="torch.optim.SGD", accelerator="cpu")) == []
    without_optimizer = parse_strategy(
        {**strategy, "config": {"zero_optimization": strategy["config"]["zero_optimization"]}}
    )
    with pytest.raises(IncompatibleConfigError, match="ZeRORuntimeException"):
        preflight(PreflightInput(strategy=without_optimizer, optimizer_target="torch.optim.SGD", accelerator="cpu"))


def test_gradient_accumulation_scheduler_with_deepspeed_refused():
    with pytest.raises(IncompatibleConfigError, match="GradientAccumulationScheduler"):
        preflight(
            PreflightInput(
                strategy=parse_strategy(preset("zero1")),
                callback_targets=("lightning.pytorch.callbacks.GradientAccumulationScheduler",),
                accelerator="cpu",
            )
        )
    preflight(
        PreflightInput(
            strategy=parse_strategy(preset("ddp")),
            callback_targets=("lightning.pytorch.callbacks.GradientAccumulationScheduler",),
            accelerator="cpu",
        )
    )


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_fp16_on_cpu_refused(precision):
    with pytest.raises(IncompatibleConfigError, match="bf16"):
        preflight(PreflightInput(strategy=parse_strategy(None), precision=precision, accelerator="cpu"))


def test_fp16_on_gpu_allowed():
    zero2 = parse_strategy(preset("zero2"))
    assert preflight(PreflightInput(strategy=zero2, precision="16-mixed", accelerator="gpu")) == []


@pytest.mark.parametrize("name", ["fsdp", "fsdp_offload"])
def test_fp16_amp_with_fsdp2_refused_on_gpu(name):
    with pytest.raises(IncompatibleConfigError, match="ModelParallelStrategy") as err:
        preflight(PreflightInput(strategy=parse_strategy(preset(name)), precision="16-mixed", accelerator="gpu"))
    assert err.value.keys == {"precision": "16-mixed", "strategy": name}
    preflight(PreflightInput(strategy=parse_strategy(preset(name)), precision="bf16-mixed", accelerator="gpu"))


def test_fp16_fsdp2_refusal_matches_lightning_behaviour():
    # Lightning refuses the precision string itself; the rule also covers the plugin path (custom loss scaler).
    import lightning.pytorch as pl

    from lightning_trainopt.parallel import TrainOptFSDPStrategy

    with pytest.raises(ValueError, match="ModelParallelStrategy` does not support"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=TrainOptFSDPStrategy(), precision="16-mixed", logger=False)


def test_nvme_without_async_io_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(pf, "_async_io_ok", lambda: False)
    strategy = {**preset("zero_infinity"), "nvme_path": str(tmp_path)}
    with pytest.raises(IncompatibleConfigError, match="libaio"):
        preflight(PreflightInput(strategy=parse_strategy(strategy), accelerator="cpu"))


def test_nvme_path_checks(monkeypatch, tmp_path):
    monkeypatch.setattr(pf, "_async_io_ok", lambda: True)
    missing = {**preset("zero_infinity"), "nvme_path": str(tmp_path / "nope")}
    with pytest.raises(ConfigError, match="strategy.nvme_path"):
        preflight(PreflightInput(strategy=parse_strategy(missing), accelerator="cpu"))
    ok = {**preset("zero_infinity"), "nvme_path": str(tmp_path)}
    monkeypatch.setattr(pf.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="not writable"):
        preflight(PreflightInput(strategy=parse_strategy(ok), accelerator="cpu"))
    monkeypatch.undo()
    monkeypatch.setattr(pf, "_async_io_ok", lambda: True)

    class Usage:
        free = 10 * 2**30

    monkeypatch.setattr(pf.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(ConfigError, match="GiB free"):
        preflight(PreflightInput(strategy=parse_strategy(ok), accelerator="cpu", n_params=7_000_000_000))
    preflight(PreflightInput(strategy=parse_strategy(ok), accelerator="cpu", n_params=1_000_000))


def test_nvme_paths_of_a_users_json_are_each_checked_under_their_own_key(monkeypatch, tmp_path):
    monkeypatch.setattr(pf, "_async_io_ok", lambda: True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()

    def strategy(param_path):
        zero = {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
            "offload_param": {"device": "nvme", "nvme_path": str(param_path)},
        }
        return {**preset("deepspeed_json"), "config": {"zero_optimization": zero}}

    with pytest.raises(ConfigError) as err:
        preflight(PreflightInput(strategy=parse_strategy(strategy(tmp_path / "nope")), accelerator="cpu"))
    assert err.value.key == "strategy.config.zero_optimization.offload_param.nvme_path"
    # Each drive needs room for what goes to it: 12 B/param of optimizer states on a, 2 B/param of weights on b.
    n_params = 1_000_000_000
    free = {str(tmp_path / "a"): 12 * n_params, str(tmp_path / "b"): 2 * n_params}
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda path: type("Usage", (), {"free": free[str(path)]}))
    preflight(PreflightInput(strategy=parse_strategy(strategy(tmp_path / "b")), accelerator="cpu", n_params=n_params))
    free[str(tmp_path / "b")] -= 1
    with pytest.raises(ConfigError, match="GiB free") as err:
        preflight(
            PreflightInput(strategy=parse_strategy(strategy(tmp_path / "b")), accelerator="cpu", n_params=n_params)
        )
    assert err.value.key == "strategy.config.zero_optimization.offload_param.nvme_path"


def test_fsdp1_on_cpu_refused():
    strategy = {"_target_": "lightning.pytorch.strategies.FSDPStrategy", "name": "fsdp1"}
    with pytest.raises(IncompatibleConfigError, match="non-CPU"):
        preflight(PreflightInput(strategy=parse_strategy(strategy), accelerator="cpu"))


def test_size_advice_warns_only_far_from_rule_of_thumb():
    def spec(name):
        return parse_strategy(preset(name))

    assert "ddp" in size_advice(125_000_000, spec("zero3_offload"))
    assert "ddp" in size_advice(125_000_000, spec("zero2_offload"))  # offload alone is far from the rule below 1B
    assert size_advice(125_000_000, spec("ddp")) is None
    assert size_advice(3_000_000_000, spec("zero2")) is None
    assert "zero2" in size_advice(3_000_000_000, spec("zero_infinity"))
    assert "may not fit" in size_advice(30_000_000_000, spec("ddp"))
    assert "may not fit" in size_advice(30_000_000_000, spec("zero1"))
    assert size_advice(30_000_000_000, spec("zero2")) is None
    assert "may not fit" in size_advice(300_000_000_000, spec("zero2"))
    assert size_advice(300_000_000_000, spec("fsdp")) is None
    advice = preflight(
        PreflightInput(strategy=parse_strategy(preset("zero3_offload")), accelerator="cpu", n_params=125_000_000)
    )
    assert len(advice) == 1


def test_preflight_from_cfg_reads_the_tree():
    cfg = OmegaConf.create(
        {
            "strategy": preset("zero2_offload"),
            "precision": {"trainer_precision": "bf16-mixed"},
            "optimizer": {"_target_": "bitsandbytes.optim.AdamW8bit", "_partial_": True},
            "callbacks": {},
            "trainer": {"accelerator": "cpu", "devices": 2, "num_nodes": 1},
            "model": {"_target_": "x", "n_layers": 2, "d_model": 64, "n_heads": 4, "ffn_hidden": 128},
        }
    )
    with pytest.raises(IncompatibleConfigError):
        preflight_from_cfg(cfg)
    with pytest.raises(IncompatibleConfigError):
        preflight(cfg)


def test_matrix_lists_every_rule():
    table = compatibility_matrix_markdown()
    refused = sum(refusal is not None for row in TABLE.values() for refusal in row.values())
    refused += sum(refusal is not None for row in ADAPTER_TABLE.values() for refusal in row.values())
    assert table.count("\n") == len(RULES) + 1 + refused
    for rule in RULES:
        assert rule.combination in table


def test_documented_matrix_is_the_generated_one():
    docs = Path(__file__).resolve().parents[3] / "docs" / "strategies.md"
    assert compatibility_matrix_markdown().rstrip("\n") in docs.read_text()


def test_non_finite_guard_skip_under_deepspeed_is_refused_before_start():
    # The guard drops gradients to skip a step; DeepSpeed steps its own partitions, so skip cannot work there.
    zero2 = parse_strategy(preset("zero2"))
    with pytest.raises(IncompatibleConfigError, match="callbacks.non_finite_guard.policy=stop"):
        preflight(PreflightInput(strategy=zero2, accelerator="cpu", non_finite_skip=True))
    assert preflight(PreflightInput(strategy=zero2, accelerator="cpu", non_finite_skip=False)) == []
    ddp = parse_strategy(preset("ddp"))
    assert preflight(PreflightInput(strategy=ddp, accelerator="cpu", non_finite_skip=True)) == []


def test_non_finite_guard_skip_is_read_from_the_callbacks_node():
    from tests.helpers.compose import compose_config

    cfg = compose_config(["+strategy=zero2", "callbacks=[non_finite_guard]", "trainer.accelerator=cpu"])
    with pytest.raises(IncompatibleConfigError, match="DeepSpeed keeps gradients in its own partitions"):
        preflight_from_cfg(cfg)
    stop = ["callbacks.non_finite_guard.policy=stop", "trainer.accelerator=cpu"]
    cfg = compose_config(["+strategy=zero2", "callbacks=[non_finite_guard]", *stop])
    assert preflight_from_cfg(cfg) == []


def test_distillation_passes_preflight_under_tensor_parallelism_and_fsdp(tmp_path):
    # Refused while TP's first-step loss differed from one device: the meta build's replay gave the student other
    # weights with a teacher beside it (parallel/meta_init.build_order; tests/integration/test_distill_sharded.py).
    from tests.helpers.compose import compose_config

    teacher = str(tmp_path / "teacher.ckpt")  # pre-flight runs before the teacher is read
    common = ["experiment=distill", f"distill.teacher={teacher}", "trainer=ddp_sim"]
    for strategy in ("+strategy=tp", "+strategy=fsdp"):
        preflight_from_cfg(compose_config([*common, strategy]))
