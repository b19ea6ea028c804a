"""``plan.py adapter=lora|qlora``, ``plan.adapters=true`` and ``plan.teacher`` on the real config tree, and the 70B
QLoRA case against Answer.AI's published figures."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_trainopt.config.plan import plan
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner import PlanInputs, StrategyLayout
from lightning_trainopt.planner.activations import ActivationPolicy
from lightning_trainopt.planner.adapters import gpt_adapter_plan
from lightning_trainopt.planner.estimate import estimate_plan
from tests.helpers.compose import compose_config

pytest.importorskip("peft")

SMALL_SEARCH = [
    "plan.search_space.precision=[bf16]",
    "plan.search_space.strategy=[ddp,fsdp,zero2]",
    "plan.search_space.activations=[checkpoint]",
    "plan.search_space.optimizer=[adamw]",
    "plan.search_space.micro_batch=[1]",
    "plan.search_space.tensor_parallel=[1]",
]


def _labels(result) -> set[str]:
    return {t.label for t in result.estimate.memory.terms}


def test_adapter_qlora_prints_the_frozen_base_its_nf4_bytes_and_scales_and_the_adapters(tmp_path):
    full = plan(compose_config(["model=gpt_125m", "hardware=a10g", "precision=bf16"], tmp_path, name="plan"))
    q = plan(compose_config(["model=gpt_125m", "hardware=a10g", "precision=bf16", "adapter=qlora"], tmp_path, "plan"))
    labels = _labels(q)
    assert {"frozen base: NF4 4-bit weights", "frozen base: NF4 scales (whole on every rank)"} <= labels
    assert any(label.startswith("adapters: ") for label in labels)
    mem, base = q.estimate.memory, full.estimate.memory
    assert mem.bytes("optimizer_states") < 0.1 * base.bytes("optimizer_states")
    assert q.estimate.train_flops_per_token < full.estimate.train_flops_per_token
    d = q.to_dict()
    assert d["adapter"]["kind"] == "qlora"
    assert d["adapter"]["r"] == 16  # conf/adapter/qlora.yaml
    assert d["adapter"]["nf4_bytes"] == pytest.approx(d["adapter"]["nf4_params"] / 2, rel=0.01)
    assert "adapter=qlora" in q.command
    assert full.to_dict()["adapter"] is None


def test_the_search_chooses_an_adapter_only_when_allowed(tmp_path):
    # llama_7b on one 24 GB card: full fine-tuning does not fit without offload; an adapter does.
    base = ["model=llama_7b", "hardware=a10g", "precision=bf16", "data.seq_len=512", "plan.search=true", *SMALL_SEARCH]
    closed = plan(compose_config(base, tmp_path, name="plan"))
    assert all("adapter" not in c.choices for c in closed.candidates)
    assert not closed.candidates  # nothing fits without an adapter in this small space
    opened = plan(compose_config([*base, "plan.adapters=true"], tmp_path, name="plan"))
    assert opened.candidates
    win = opened.candidates[0]
    assert win.choices["adapter"] in ("lora", "qlora")
    assert f"adapter={win.choices['adapter']}" in opened.command
    assert {c.choices["adapter"] for c in opened.candidates} <= {"lora", "qlora"}
    # The adapter x strategy table refuses QLoRA under DeepSpeed: the search never offers the pair.
    pairs = {(c.choices["adapter"], c.choices["strategy"]) for c in opened.candidates}
    assert ("qlora", "zero2") not in pairs
    assert ("lora", "zero2") in pairs


def test_plan_refuses_the_pairs_train_refuses(tmp_path):
    args = ["model=gpt_tiny", "hardware=a10g", "trainer.devices=2", "+strategy=zero2", "adapter=qlora"]
    with pytest.raises(IncompatibleConfigError, match="adapter"):
        plan(compose_config(args, tmp_path, name="plan"))


def test_plan_adapters_must_be_a_boolean(tmp_path):
    cfg = compose_config(
        ["model=gpt_tiny", "hardware=cpu", "plan.search=true", "plan.adapters=maybe"], tmp_path, "plan"
    )
    with pytest.raises(ConfigError, match=r"plan\.adapters"):
        plan(cfg)


def test_a_teacher_adds_its_weights_and_forward_flops(tmp_path):
    args = ["model=gpt_tiny", "hardware=cpu"]
    alone = plan(compose_config(args, tmp_path, name="plan"))
    taught = plan(compose_config([*args, "plan.teacher=gpt_125m"], tmp_path, name="plan"))
    t = taught.estimate.inputs.teacher
    assert t is not None
    assert t.name == "gpt_125m"
    teacher_bytes = sum(x.nbytes for x in taught.estimate.memory.terms if x.label.startswith("teacher (gpt_125m)"))
    assert teacher_bytes == 4 * t.n_params  # fp32 compute precision, one device
    extra = taught.estimate.train_flops_per_token - alone.estimate.train_flops_per_token
    assert extra == pytest.approx(t.forward_flops_per_token, rel=1e-6)
    assert t.forward_flops_per_token > 2 * t.n_params * 0.9  # at least 2 FLOPs per weight per token
    with pytest.raises(ConfigError, match=r"plan\.teacher"):
        plan(compose_config([*args, "plan.teacher=nope"], tmp_path, name="plan"))


#: Llama-2-70B (Meta's config.json), the model of Answer.AI's runs: 80 layers, hidden 8192, 64 heads, 8 KV heads,
#: FFN 28672, vocabulary 32000, untied head.
LLAMA2_70B = GPTConfig(
    name="llama2_70b",
    vocab_size=32000,
    n_layers=80,
    d_model=8192,
    n_heads=64,
    n_kv_heads=8,
    ffn_hidden=28672,
    max_seq_len=4096,
    tie_embeddings=False,
)
GB = 1e9


def _answer_ai(offload: bool) -> float:
    """Peak per GPU of Answer.AI's fsdp_qlora command (README: Llama-2-70B, batch 2, context 2048, bf16, QLoRA with
    their defaults r 64 on every linear layer and dropout 0.1, gradient checkpointing, FSDP over 2 GPUs)."""
    layout = StrategyLayout(
        name="fsdp_offload" if offload else "fsdp",
        kind="fsdp",
        offload_params="cpu" if offload else "none",
        offload_optimizer="cpu" if offload else "none",
    )
    adapter = gpt_adapter_plan(LLAMA2_70B, "qlora", 64, dropout=0.1)
    inputs = PlanInputs(
        LLAMA2_70B,
        trainer_precision="bf16-true",
        layout=layout,
        micro_batch=2,
        seq_len=2048,
        devices=2,
        activations=ActivationPolicy(name="checkpoint", checkpoint_every=1),
        adapter=adapter,
    )
    return estimate_plan(inputs, 24 * 2**30, None, None).peak_device_bytes / GB


def test_70b_qlora_on_two_24gb_cards_against_answer_ai():
    """Answer.AI (https://www.answer.ai/posts/2024-03-06-fsdp-qlora, as issue #22 quotes it): 19.6 GB per GPU with CPU
    offload, 35.6 GB without. The planner agrees on the verdict (a 24 GB card fits it only with offload); without
    offload it lands within 5% of 35.6 GB. With offload it plans about 11.4 GB: a lower figure, since the quoted ones
    are what the CUDA caching allocator reserved in Answer.AI's stack (FSDP1 flat parameters, the CUDA context,
    fragmentation), which grow in share as the allocated bytes shrink; the planner counts allocated tensors (its
    headroom_fraction is kept for the rest). Their own benchmark table gives 14.92 GiB (16.0 GB) for the same command
    (benchmarks_03_2024.md), so the published figures themselves differ by 3.6 GB."""
    with_offload, without = _answer_ai(True), _answer_ai(False)
    assert with_offload < 24 * 2**30 / GB < without
    assert without == pytest.approx(35.6, rel=0.05)
    assert 0.5 * 19.6 < with_offload < 19.6


def test_the_distill_nodes_teacher_is_planned(tmp_path):
    """Under experiment=distill: a GPTConfig teacher_model node, or a local Hugging Face directory's config.json."""
    import transformers
    from omegaconf import OmegaConf

    from lightning_trainopt.config.plan_adapter import teacher_plan
    from lightning_trainopt.config.tree import CONF_DIR
    from lightning_trainopt.models.gpt import GPT

    shape = GPTConfig(name="t", vocab_size=64, n_layers=2)
    node = {"_target_": "lightning_trainopt.models.GPTConfig", **dataclasses.asdict(shape)}
    gpt = teacher_plan(OmegaConf.create({"distill": {"teacher": "x.ckpt", "teacher_model": node}}), CONF_DIR, 32)
    assert gpt is not None
    assert gpt.n_params == sum(p.numel() for p in GPT(shape).parameters())
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    config.save_pretrained(tmp_path)
    hf = teacher_plan(OmegaConf.create({"distill": {"teacher": str(tmp_path)}}), CONF_DIR, 32)
    assert hf is not None
    assert hf.n_params == sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    assert hf.forward_flops_per_token == 2 * hf.n_params  # as SpeedMonitor counts a non-GPT teacher
    assert teacher_plan(OmegaConf.create({}), CONF_DIR, 32) is None
    # plan.py experiment=distill distill.teacher=DIR: the teacher's rows and FLOPs are in the plan.
    result = plan(
        compose_config(["experiment=distill", f"distill.teacher={tmp_path}", "hardware=cpu"], tmp_path, "plan")
    )
    assert result.estimate.inputs.teacher == hf or result.estimate.inputs.teacher.n_params == hf.n_params
    assert result.to_dict()["teacher"]["n_params"] == hf.n_params


def test_the_70b_qlora_preset_plans_to_fit_two_24gb_cards_and_its_command_composes(tmp_path):
    """``experiment=qlora_70b`` is Answer.AI's run as a preset (with Llama-3-70B's shape, our ``llama_70b``): it fits a
    24 GB card with offload, its optimizer step covers the adapters only, and the ``run it`` command composes again
    (the preset brings its strategy: a ``+strategy=`` beside it would fail to compose)."""
    import shlex

    result = plan(compose_config(["experiment=qlora_70b", "hardware=a10g"], tmp_path, "plan"))
    inputs = result.estimate.inputs
    assert inputs.adapter is not None
    assert (inputs.adapter.kind, inputs.adapter.r) == ("qlora", 64)
    assert (inputs.devices, inputs.micro_batch, inputs.seq_len) == (2, 2, 2048)
    assert inputs.layout.name == "fsdp_offload"
    assert result.estimate.peak_device_bytes < 24 * 2**30 * 0.95
    adam = result.estimate.speed.overhead.serial["CPU AdamW (fused)"]
    assert adam == pytest.approx(-(-inputs.adapter.n_adapter // 2) * 2 / _cpu_adam_rate(), rel=1e-6)
    assert "+strategy" not in result.command
    overrides = [o for o in shlex.split(result.command)[2:] if not o.startswith("--config-dir")]
    again = compose_config(overrides, tmp_path)
    assert (again.adapter.r, again.strategy.preset, again.trainer.devices) == (64, "fsdp_offload", 2)


def _cpu_adam_rate() -> float:
    from lightning_trainopt.metrics.hardware import HARDWARE

    return HARDWARE["a10g"].cpu_adam_params_per_s
