"""The ``adapter`` group: read into ``RunSpec.adapter``, and refused before training where it cannot work."""

from __future__ import annotations

import pytest

from lightning_trainopt.config.preflight import preflight_from_cfg
from lightning_trainopt.config.run_spec import run_spec
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.transforms.adapters import AdapterSpec
from tests.helpers.compose import compose_config
from tests.integration.test_adapter_sharding import COMBINED

CPU = "trainer.accelerator=cpu"


def test_the_default_is_no_adapter_and_presets_read_into_the_spec():
    assert run_spec(compose_config([CPU])).adapter == AdapterSpec(kind="none")
    lora = run_spec(compose_config([CPU, "adapter=lora", "adapter.r=8", "adapter.target_modules=[q_proj,v_proj]"]))
    assert lora.adapter == AdapterSpec(kind="lora", r=8, alpha=32, dropout=0.05, target_modules=("q_proj", "v_proj"))
    qlora = run_spec(compose_config([CPU, "adapter=qlora"])).adapter
    assert (qlora.kind, qlora.quant_type, qlora.double_quant, qlora.quant_storage) == ("qlora", "nf4", True, "bfloat16")


def test_a_bad_rank_names_the_key():
    with pytest.raises(ConfigError) as err:
        run_spec(compose_config([CPU, "adapter=lora", "adapter.r=0"]))
    assert err.value.key == "adapter.r"


@pytest.mark.parametrize("precision", ["fp8", "fp16"])
def test_qlora_with_fp8_or_fp16_is_refused_with_what_works(precision):
    with pytest.raises(IncompatibleConfigError, match="precision=bf16") as err:
        preflight_from_cfg(compose_config([CPU, "adapter=qlora", f"precision={precision}"]))
    assert "adapter" in str(err.value)


@pytest.mark.parametrize("precision", ["bf16", "bf16_true", "fp32"])
def test_qlora_with_bf16_or_fp32_passes(precision):
    preflight_from_cfg(compose_config([CPU, "adapter=qlora", f"precision={precision}"]))


#: The app's overrides for a transform of tests/integration/test_adapter_sharding.py's cases.
TRANSFORM_OVERRIDES = {
    "ckpt": "activations=checkpoint",
    "int8": "activations=int8",
    "chunked_ce": "loss=chunked_ce",
    "bf16": "precision=bf16",
}


@pytest.mark.parametrize("case", COMBINED)
def test_the_sharded_adapter_cases_with_transforms_pass_the_apps_preflight(case):
    """What the 2-process worker fits with an adapter, a sharding strategy and the transforms (it builds them from the
    same config files, bypassing pre-flight) is what ``train.py`` accepts: nothing there is refused."""
    strategy, adapter, *rest = case.split(":")
    overrides = [TRANSFORM_OVERRIDES[t] for t in rest[-1].split("+")]
    preflight_from_cfg(compose_config(["trainer=ddp_sim", f"+strategy={strategy}", f"adapter={adapter}", *overrides]))


def test_a_target_the_model_lacks_is_refused_before_training_listing_its_layers():
    cfg = compose_config([CPU, "adapter=lora", "adapter.target_modules=[q_proj,attn_out]"])
    with pytest.raises(ConfigError, match=r"\['attn_out'\] match no linear layer.*'down_proj'") as err:
        preflight_from_cfg(cfg)
    assert err.value.key == "adapter.target_modules"
