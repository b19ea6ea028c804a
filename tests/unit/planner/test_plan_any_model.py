"""plan.py plans any model: a Hugging Face config (``model=hf``) and a user's LightningModule (``model=module``),
read on the meta device, activations measured on fake tensors equal to a real CPU forward's."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_trainopt.config.plan import plan, plan_task
from lightning_trainopt.config.plan_model import module_plan_profile, token_batch, token_dict_batch, training_loss
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.saved_tensors import SavedTensorsCounter, transform_saved_tensors
from lightning_trainopt.planner import ActivationPolicy
from tests.helpers.compose import compose_config

pytest.importorskip("transformers")

USER_LM = "tests.helpers.user_module.UserLM"
# (trainer precision's compute bytes, autocast, the weights' dtype): fp32, bf16-mixed, bf16-true / DeepSpeed half.
PRECISIONS = [(4, False, torch.float32), (2, True, torch.float32), (2, False, torch.bfloat16)]
POLICIES = [ActivationPolicy(), ActivationPolicy(1), ActivationPolicy(2), ActivationPolicy(compress_bits=8)]


def _hf_module(tmp_path, device: str | None = None):
    from lightning_trainopt.models import HFModelConfig, LitCausalLM
    from tests.helpers.hf_files import write_config

    config = write_config("llama", tmp_path / "llama")
    with torch.device(device or "cpu"):
        module = LitCausalLM(HFModelConfig(config=str(config)))
        module.configure_model()
    return module


def _measured(module, batch, autocast: bool, policy: ActivationPolicy) -> int:
    """Saved-for-backward bytes of one real CPU training step with the real techniques."""
    from lightning_trainopt.transforms.checkpointing import CheckpointPolicy, apply_activation_checkpointing
    from lightning_trainopt.transforms.compression import Int8Compressor

    if policy.checkpoint_every:
        apply_activation_checkpointing(module, CheckpointPolicy(every_k=policy.checkpoint_every))
    compressor = Int8Compressor() if policy.compress_bits else None
    with (
        SavedTensorsCounter(params=module.parameters()) as counter,
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        if compressor is None:
            training_loss(module, batch)
        else:
            with transform_saved_tensors(compressor):
                training_loss(module, batch)
    return counter.report().activation_bytes


@pytest.mark.parametrize(("compute_bytes", "autocast", "dtype"), PRECISIONS)
def test_hf_llama_activations_equal_a_real_forward(tmp_path, compute_bytes, autocast, dtype):
    profile = module_plan_profile(_hf_module(tmp_path, "meta"), "llama", 128)
    x, y = (torch.randint(0, 256, (3, 48)) for _ in range(2))
    for policy in POLICIES:
        torch.manual_seed(0)
        real = _hf_module(tmp_path).to(dtype)
        planned = profile.activations(3, 48, compute_bytes, autocast, policy, "sdpa").bytes("activations")
        assert planned == _measured(real, (x, y), autocast, policy), policy


def test_user_module_activations_equal_a_real_forward():
    from tests.helpers.user_module import UserLM

    with torch.device("meta"):
        meta = UserLM()
    profile = module_plan_profile(meta, "UserLM")
    # UserLM's training step takes dict batches: the planner found that format itself.
    batch = {k: v.random_(0, 256) if k != "attention_mask" else v for k, v in token_dict_batch(4, 40).items()}
    for compute_bytes, autocast, dtype in PRECISIONS:
        for policy in POLICIES:
            planned = profile.activations(4, 40, compute_bytes, autocast, policy, "sdpa").bytes("activations")
            assert planned == _measured(UserLM().to(dtype), batch, autocast, policy), (dtype, autocast, policy)


def test_flops_are_counted_and_checkpointing_adds_the_recomputed_forward(tmp_path):
    profile = module_plan_profile(_hf_module(tmp_path, "meta"), "llama", 128)
    model, recomputed = profile.flops(2, 64)
    # At least the 6 x parameters x tokens of the matrix products (the embedding is a lookup), below 8x.
    matmul = profile.n_params - 256 * 32
    assert 6 * matmul * 128 <= model < 8 * profile.n_params * 128
    assert 0 < recomputed < model / 3  # a share of the forward (a third of the step)
    assert profile.flops(4, 64)[0] == 2 * model  # linear in the micro-batch


def test_a_training_step_that_cannot_run_on_fake_tensors_is_refused_naming_the_model():
    class ReadsValues(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

        def training_step(self, batch, batch_idx):
            x = batch[0] if isinstance(batch, tuple) else batch["input_ids"]
            return self.embed(x[:, : int(x.max())]).sum()  # reads a value

    with pytest.raises(ConfigError, match="model") as info:
        module_plan_profile(ReadsValues(), "ReadsValues")
    assert "token_batch" in str(info.value)
    assert "token_dict_batch" in str(info.value)


def test_plan_py_model_hf_prints_json_with_the_module_s_counts(tmp_path, capsys):
    from tests.helpers.hf_files import write_config

    config = write_config("llama", tmp_path / "llama")
    overrides = [
        "model=hf",
        f"model.config={config}",
        "hardware=cpu",
        "trainer.devices=2",
        "+strategy=zero2",
        "precision=bf16",
        "data.seq_len=32",
        "data.batch_size=2",
        "plan.format=json",
    ]
    plan_task(compose_config(overrides, tmp_path, name="plan"))
    out = json.loads(capsys.readouterr().out)
    real = _hf_module(tmp_path)
    assert out["n_params"] == sum(p.numel() for p in real.parameters())
    # ZeRO-2 in bf16: the flat half weights padded to 2 x world, the fp32 master and Adam's two moments / 2 ranks.
    groups = [
        sum(p.numel() for p in real.parameters() if p.dim() >= 2),
        sum(p.numel() for p in real.parameters() if p.dim() < 2),
    ]
    padded = [-(-g // 4) * 4 for g in groups]
    assert out["memory_breakdown"]["params"]["device"] == 2 * sum(padded)
    assert out["memory_breakdown"]["optimizer_states"]["device"] == 12 * sum(padded) // 2 + 4 * len(groups)
    # DeepSpeed hands the model bf16 without autocast: activations as a real bf16 forward saves them.
    assert out["per_device_bytes"]["activations"] == _measured(
        real.to(torch.bfloat16), token_batch(2, 32), False, ActivationPolicy()
    )
    assert out["model_flops_per_token"] > 6 * (out["n_params"] - 256 * 32)
    assert out["command"].startswith("python train.py model=hf model.config=")
    assert out["model"] == {
        "name": "llama",
        "source": "measured",
        "block_class": "LlamaDecoderLayer",
        "n_blocks": 2,
        "tied_params": 0,
        "max_seq_len": 128,
    }


def test_plan_searches_a_user_module(tmp_path):
    overrides = [
        "model=module",
        f"model._target_={USER_LM}",
        "hardware=a100_80gb",
        "trainer.devices=2",
        "data.seq_len=64",
        "data.batch_size=4",
        "plan.search=true",
        "plan.search_space.precision=[bf16,bf16_true]",
        "plan.search_space.strategy=[ddp,zero2,fsdp]",
        "plan.search_space.activations=[none,checkpoint,int8]",
        "plan.search_space.optimizer=[adamw]",
        "plan.search_space.micro_batch=[2,4]",
    ]
    result = plan(compose_config(overrides, tmp_path, name="plan"))
    assert result.n_enumerated == 2 * 3 * 3 * 2
    assert result.candidates
    assert result.command.startswith(f"python train.py model=module model._target_={USER_LM}")
    assert {c.choices["activations"] for c in result.candidates} == {"none", "checkpoint", "int8"}
    by = {
        (c.choices["precision"], c.choices["strategy"], c.choices["activations"], c.estimate.inputs.micro_batch): c
        for c in result.candidates
    }
    compared = 0
    for (precision, strategy, activations, micro), c in by.items():
        kept = by.get((precision, strategy, "none", micro))
        if activations != "none" and kept is not None:  # both at their best micro-batch, and it is the same one
            assert c.estimate.memory.bytes("activations") < kept.estimate.memory.bytes("activations")
            compared += 1
    assert compared


def test_our_model_is_planned_analytically(tmp_path, capsys):
    overrides = ["model=gpt_tiny", "hardware=cpu", "data.seq_len=64", "plan.format=json"]
    plan_task(compose_config(overrides, tmp_path, name="plan"))
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == {
        "name": "gpt_tiny",
        "source": "analytic",
        "block_class": "Block",
        "n_blocks": 4,
        "tied_params": 256 * 128,
        "max_seq_len": 512,
    }
