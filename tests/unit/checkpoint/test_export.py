"""trainopt-export: a LoRA/QLoRA checkpoint merged into its base, written as a state dict, a peft adapter directory or a
Hugging Face model directory, each loaded back by its library with the adapter model's outputs."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_trainopt.checkpoint.export import export_checkpoint, main, merge_lora
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPTConfig, HFModelConfig, LitCausalLM, LitGPT
from lightning_trainopt.transforms.adapters import AdapterSpec, apply_adapter, describe

TARGETS = ["q_proj", "v_proj", "down_proj"]
ALPHA = 16
R = 4
IDX = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _lora(r: int = R, alpha: float = ALPHA) -> Any:
    from peft import LoraConfig

    # init_lora_weights=False: B is random, not zero, so the merge changes the weights (as after training).
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)


def _save(path: Path, state: dict[str, torch.Tensor], shape: dict[str, Any], adapter: dict | None) -> Path:
    """A checkpoint file as Lightning writes one (``state_dict`` + ``hyper_parameters``)."""
    hyper: dict[str, Any] = {"model": shape, **({"adapter": adapter} if adapter is not None else {})}
    torch.save({"state_dict": state, "hyper_parameters": hyper, "global_step": 3}, path)
    return path


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(IDX)
    return out if isinstance(out, torch.Tensor) else out.logits


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=64,  # bitsandbytes' CPU 4-bit matmul needs rows of at least one block (64)
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )


def _adapted(config: Any, folder: Path, spec: AdapterSpec) -> tuple[LitCausalLM, dict[str, Any]]:
    """Our LitCausalLM of ``config`` (saved to ``folder``) with ``spec``'s adapter applied as training applies it,
    its B matrices moved off zero as training moves them; and its ``model`` hyper-parameters."""
    config.save_pretrained(folder)
    shape = asdict(HFModelConfig(config=str(folder)))
    torch.manual_seed(0)
    module = LitCausalLM(HFModelConfig(**shape))
    module.configure_model()
    apply_adapter(module, spec)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return module, shape


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Hugging Face Llama in our LitCausalLM with LoRA on q/v/down, its checkpoint file and its logits."""
    tmp = tmp_path_factory.mktemp("llama")
    spec = AdapterSpec(kind="lora", r=R, alpha=ALPHA, dropout=0.0, target_modules=tuple(TARGETS))
    module, shape = _adapted(_llama_config(), tmp / "config", spec)
    plain = {
        k.removeprefix("model.").replace(".base_layer", ""): v.clone()
        for k, v in module.state_dict().items()
        if "lora_" not in k
    }
    ckpt = _save(tmp / "lora.ckpt", module.state_dict(), shape, describe(spec))
    return {"tmp": tmp, "shape": shape, "ckpt": ckpt, "plain": plain, "logits": _logits(module.model)}


def _base(llama: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama["tmp"] / "config"))
    model.load_state_dict(llama["plain"], strict=True)
    return model


def test_the_merged_hugging_face_directory_gives_the_adapter_models_logits(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    main([str(llama["ckpt"]), "--out", str(tmp_path / "hf"), "--format", "hf"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert merged.dtype == torch.float32  # auto: as the base was saved
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    assert _logits(merged).abs().max() > 0.1
    torch.testing.assert_close(_logits(merged), llama["logits"], rtol=0, atol=1e-5)
    # The merge changed the base: the plain base alone gives other logits.
    assert not torch.allclose(_logits(_base(llama)), llama["logits"], atol=1e-3)


def test_the_peft_directory_loads_onto_the_base_with_the_same_logits(llama, tmp_path):
    from peft import PeftModel

    main([str(llama["ckpt"]), "--out", str(tmp_path / "peft"), "--format", "peft"])
    assert {p.name for p in (tmp_path / "peft").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    model = PeftModel.from_pretrained(_base(llama), tmp_path / "peft")
    assert model.peft_config["default"].lora_alpha == ALPHA
    torch.testing.assert_close(_logits(model), llama["logits"], rtol=0, atol=1e-5)


def test_the_state_dict_holds_no_adapter_and_equals_the_merge_by_formula(llama, tmp_path):
    main([str(llama["ckpt"]), "--out", str(tmp_path), "--format", "state_dict"])
    state = torch.load(tmp_path / "state_dict.pt", weights_only=True)
    assert state.keys() == llama["plain"].keys()  # no lora_A/lora_B/base_layer name left
    model = _base(llama)
    model.load_state_dict(state, strict=True)
    torch.testing.assert_close(_logits(model), llama["logits"], rtol=0, atol=1e-5)
    # peft's merge equals W + alpha / r * B @ A, the formula used for a model that cannot be rebuilt.
    full = {k.removeprefix("model."): v for k, v in torch.load(llama["ckpt"])["state_dict"].items()}
    pairs = {
        k.removesuffix(".lora_A.default.weight"): (v, full[k.replace("lora_A", "lora_B")])
        for k, v in full.items()
        if k.endswith("lora_A.default.weight")
    }
    by_formula = merge_lora(full, pairs, _lora(), "default", None)
    assert by_formula.keys() == state.keys()
    for key, tensor in state.items():
        torch.testing.assert_close(by_formula[key], tensor, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_qlora_checkpoint_is_merged_into_its_dequantized_base(arch, tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    config = _llama_config() if arch == "llama" else GPT2Config(vocab_size=64, n_embd=64, n_layer=2, n_head=4)
    # The architecture's default targets (GPT-2: its Conv1D layers, stored (in, out)); fp32 compute, to compare.
    spec = AdapterSpec(kind="qlora", r=R, alpha=ALPHA, dropout=0.0, compute_dtype="float32")
    module, shape = _adapted(config, tmp_path / "config", spec)
    # Taken before any forward: bitsandbytes' CPU forward repacks the weight and rounds the block scales to bf16.
    state = {k: v.clone() for k, v in module.state_dict().items()}
    assert any(k.endswith("quant_state.bitsandbytes__nf4") for k in state)
    expected = _qlora_merge_by_hand(module.model, transpose=arch == "gpt2")
    ckpt = _save(tmp_path / "qlora.ckpt", state, shape, describe(spec))

    with pytest.warns(UserWarning, match="dequantized base plus the adapter's delta"):
        report = export_checkpoint(ckpt, tmp_path / "fp32", "hf", dtype="float32")
    assert report.dequantized == len(expected) == 2 * (7 if arch == "llama" else 4)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert merged.config.tie_word_embeddings == config.tie_word_embeddings  # GPT-2's tied head stays tied
    weights = merged.state_dict()
    for key, weight in expected.items():
        torch.testing.assert_close(weights[key], weight, rtol=0, atol=1e-6, msg=key)
    # The 4-bit model's own outputs: bitsandbytes' CPU kernel multiplies with bf16 block scales, so they agree to
    # bf16 rounding (measured 2.4e-3 at most on the Llama, logits up to about 1), not to fp32's.
    torch.testing.assert_close(_logits(merged), _logits(module.model), rtol=0, atol=5e-3)
    if arch == "llama":
        # The default output dtype of a QLoRA checkpoint is bf16, its compute dtype on a GPU.
        with pytest.warns(UserWarning, match="4-bit"):
            report = export_checkpoint(ckpt, tmp_path / "bf16", "hf")
        assert report.dtype == torch.bfloat16
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    # GPT-2's Conv1D weights are (in, out): its adapter_config.json says so, as peft's own save writes it (it said
    # false, and PeftModel.from_pretrained warned; found by review).
    export_checkpoint(ckpt, tmp_path / "peft", "peft")
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert written["fan_in_fan_out"] is (arch == "gpt2")


def _qlora_merge_by_hand(model: torch.nn.Module, transpose: bool) -> dict[str, torch.Tensor]:
    """``{Hugging Face weight name: bitsandbytes' dequantized weight + peft's delta}`` of each 4-bit layer, in
    ``nn.Linear``'s (out, in) layout as Linear4bit holds it, or ``transpose``d to GPT-2's Conv1D (in, out)."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            out[f"{name.removesuffix('.base_layer')}.weight"] = weight
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            out[f"{name}.weight"] = out[f"{name}.weight"] + module.get_delta_weight("default").float()
    return {key: weight.t() if transpose else weight for key, weight in out.items()}


def test_our_gpt_with_lora_exports_as_a_llama_with_the_same_logits(tmp_path):
    from peft import inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    shape = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16)
    torch.manual_seed(0)
    module = LitGPT(shape)
    module.configure_model()
    inject_adapter_in_model(_lora(), module.model)
    ckpt = _save(tmp_path / "gpt.ckpt", module.state_dict(), asdict(shape), {"kind": "lora", "alpha": ALPHA})
    main([str(ckpt), "--out", str(tmp_path / "hf")])  # --format hf is the default
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(llama).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(llama), _logits(module.model), rtol=0, atol=1e-5)


def test_a_checkpoint_without_its_frozen_base_gets_it_rebuilt_and_checked(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from lightning_trainopt.checkpoint.adapter_state import ADAPTER_KEY, strip_frozen_base

    shape = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16)
    spec = AdapterSpec(kind="lora", r=R, alpha=ALPHA, dropout=0.0, target_modules=tuple(TARGETS))
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")  # what seed_everything(3) leaves, and the checkpoint records
    torch.manual_seed(3)
    module = LitGPT(shape)
    module.configure_model()
    apply_adapter(module, spec)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    strip_frozen_base(module, checkpoint, spec)  # as an adapter=lora run's checkpoints are written
    assert set(checkpoint["state_dict"]) == set(checkpoint[ADAPTER_KEY]["adapter_tensors"])  # the base is left out
    torch.save(checkpoint, tmp_path / "adapters.ckpt")
    main([str(tmp_path / "adapters.ckpt"), "--out", str(tmp_path / "hf")])  # alpha: recorded with the adapter
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(_logits(llama), _logits(module.model), rtol=0, atol=1e-5)

    checkpoint[ADAPTER_KEY]["base_sha256"] = "0" * 64  # adapters trained on another base than this one rebuilds
    torch.save(checkpoint, tmp_path / "other_base.ckpt")
    err = _refused([str(tmp_path / "other_base.ckpt"), "--out", str(tmp_path / "x")], capsys)
    assert "not the one the adapters were trained on" in err
    assert "--format peft" in err
    main([str(tmp_path / "other_base.ckpt"), "--out", str(tmp_path / "peft"), "--format", "peft"])  # needs no base


def test_a_run_folder_exports_its_newest_checkpoint_with_the_alpha_of_its_config(llama, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(f"adapter:\n  kind: lora\n  r: {R}\n  alpha: {ALPHA}\n")
    state = torch.load(llama["ckpt"])["state_dict"]
    _save(run / "checkpoints" / "last.ckpt", state, llama["shape"], adapter=None)
    report = export_checkpoint(run, tmp_path / "out", "state_dict")
    assert report.checkpoint == run / "checkpoints" / "last.ckpt"
    assert report.adapted_modules == 2 * len(TARGETS)
    merged = torch.load(tmp_path / "out" / "state_dict.pt", weights_only=True)
    model = _base(llama)
    model.load_state_dict(merged)
    torch.testing.assert_close(_logits(model), llama["logits"], rtol=0, atol=1e-5)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_input_is_refused_with_what_and_the_fix_and_exit_code_2(llama, tmp_path, capsys):
    plain = _save(tmp_path / "plain.ckpt", {f"model.{k}": v for k, v in llama["plain"].items()}, llama["shape"], None)
    err = _refused([str(plain), "--out", str(tmp_path / "a"), "--format", "peft"], capsys)
    assert "holds no LoRA adapter" in err
    assert "--format state_dict or hf" in err
    assert not (tmp_path / "a").exists()

    err = _refused([str(tmp_path / "nowhere"), "--out", str(tmp_path / "b")], capsys)
    assert "checkpoint=" in err
    assert "nowhere" in err
    assert "does not exist" in err

    data = llama["ckpt"].read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])  # a write killed half-way
    err = _refused([str(tmp_path / "cut.ckpt"), "--out", str(tmp_path / "c")], capsys)
    assert "cut.ckpt" in err
    assert "truncated" in err
    assert "export another checkpoint" in err

    no_alpha = _save(tmp_path / "no_alpha.ckpt", torch.load(llama["ckpt"])["state_dict"], llama["shape"], None)
    err = _refused([str(no_alpha), "--out", str(tmp_path / "d")], capsys)
    assert "--lora-alpha" in err
    assert "adapter.alpha" in err
    main([str(no_alpha), "--out", str(tmp_path / "d"), "--lora-alpha", str(ALPHA)])  # the fix it names works
    err = _refused([str(llama["ckpt"]), "--out", str(tmp_path / "e"), "--lora-alpha", "4"], capsys)
    assert "records adapter alpha 16" in err

    qlora = describe(AdapterSpec(kind="qlora", r=R, alpha=ALPHA))
    unquantized = _save(tmp_path / "qlora.ckpt", torch.load(llama["ckpt"])["state_dict"], llama["shape"], qlora)
    err = _refused([str(unquantized), "--out", str(tmp_path / "f")], capsys)
    assert "adapter=qlora run but holds no bitsandbytes quantization state" in err
    assert "--format peft" in err

    err = _refused([str(llama["ckpt"]), "--out", str(tmp_path / "d")], capsys)  # written above: not overwritten
    assert "--out=" in err
    assert "already holds files" in err


def test_a_directory_that_is_no_checkpoint_is_named(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ConfigError, match="neither a DeepSpeed checkpoint"):
        export_checkpoint(tmp_path / "x", tmp_path / "out")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``zero3.ckpt/`` and ``fsdp2.ckpt/`` from one 2-process run (one step each), ``single.ckpt`` from the same step on
    this process."""
    import subprocess
    import sys

    from tests.helpers.compose import REPO_ROOT
    from tests.helpers.env import child_env
    from tests.unit.checkpoint._export_worker import fit

    out = tmp_path_factory.mktemp("sharded")
    worker = Path(__file__).with_name("_export_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("zero3", "fsdp2"):
        for rank in (0, 1):
            assert f"rank {rank}: {name} saved step 1" in proc.stdout, proc.stdout[-3000:]
    fit("single", str(out))
    return out


@pytest.mark.slow
def test_zero3_and_fsdp2_shards_merge_to_what_a_single_process_run_merges(sharded, tmp_path):
    from lightning_trainopt.checkpoint.dcp import is_dcp_checkpoint
    from tests.unit.checkpoint._export_worker import ALPHA as WORKER_ALPHA

    assert is_dcp_checkpoint(sharded / "fsdp2.ckpt")
    assert (sharded / "zero3.ckpt" / "checkpoint").is_dir()
    merged = {}
    for name in ("single", "zero3", "fsdp2"):
        report = export_checkpoint(sharded / f"{name}.ckpt", tmp_path / name, "state_dict", lora_alpha=WORKER_ALPHA)
        assert report.adapted_modules == 2 * len(TARGETS)
        merged[name] = torch.load(tmp_path / name / "state_dict.pt", weights_only=True)
    saved = torch.load(sharded / "single.ckpt", weights_only=False)["state_dict"]
    base = {k.removeprefix("model.").replace(".base_layer", ""): v for k, v in saved.items() if "lora_" not in k}
    assert merged["single"].keys() == base.keys()
    assert not torch.allclose(merged["single"]["blocks.0.attn.v_proj.weight"], base["blocks.0.attn.v_proj.weight"])
    for name in ("zero3", "fsdp2"):
        assert merged[name].keys() == base.keys()
        for key, tensor in merged["single"].items():
            # The same step on the same 4 sequences, the gradient summed over 2 ranks instead of 1: fp32 rounding.
            torch.testing.assert_close(merged[name][key], tensor, rtol=0, atol=1e-6, msg=f"{name}: {key}")

    # The adapter alone from the ZeRO-3 shards (its trainable partitions), as the single run holds it.
    export_checkpoint(sharded / "zero3.ckpt", tmp_path / "peft", "peft", lora_alpha=WORKER_ALPHA)
    from safetensors.torch import load_file

    adapter = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    for key, tensor in saved.items():
        if "lora_" in key:
            name = "base_model.model." + key.removeprefix("model.").replace(".default", "")
            torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_truncated_rank_file_of_a_sharded_checkpoint_is_refused(sharded, tmp_path, capsys):
    import shutil

    cut = tmp_path / "fsdp2.ckpt"
    shutil.copytree(sharded / "fsdp2.ckpt", cut)
    part = cut / "__1_0.distcp"
    part.write_bytes(part.read_bytes()[:100])
    err = _refused([str(cut), "--out", str(tmp_path / "out"), "--lora-alpha", "16"], capsys)
    assert "__1_0.distcp" in err
    assert "truncated" in err
