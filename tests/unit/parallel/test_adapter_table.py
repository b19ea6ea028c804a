"""The adapter dimension of the rewrite table (``parallel/compat_table.py``): pre-flight (``train.py``) and
``plan.py``'s compatibility check refuse exactly its refused cells, with the reason and the fix; and the pieces of
``parallel/adapters.py`` that run without a process group (the 2-process fits are in
``tests/integration/test_adapter_sharding.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_trainopt.config.plan_inputs import check_compatible
from lightning_trainopt.config.preflight import PreflightInput, adapter_kind, preflight
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.parallel.adapters import has_adapters, prepare_4bit_for_fsdp2, restore_adapter_init
from lightning_trainopt.parallel.compat_table import ADAPTER_TABLE, ADAPTERS, FAMILIES, adapter_cell, refusals_markdown
from lightning_trainopt.parallel.spec import parse_strategy

CONF = Path(__file__).resolve().parents[3] / "lightning_trainopt" / "conf" / "strategy"
#: A shipped preset (or a plain node) per family, with ``(tensor_parallel, world_size)``.
FAMILY_PRESETS: dict[str, tuple[str | dict | None, int, int]] = {
    "single": (None, 1, 1),
    "ddp": ("ddp", 1, 2),
    "zero12": ("zero2", 1, 2),
    "zero3": ("zero3", 1, 2),
    "fsdp2": ("fsdp", 1, 2),
    "fsdp1": ({"_target_": "lightning.pytorch.strategies.FSDPStrategy", "name": "fsdp1"}, 1, 2),
    "tp": ("tp", 2, 2),
    "fsdp_tp": ("fsdp_tp", 2, 4),
}


def _node(family: str) -> dict | None:
    preset = FAMILY_PRESETS[family][0]
    if isinstance(preset, str):
        return yaml.safe_load((CONF / f"{preset}.yaml").read_text())
    return preset


def _input(adapter: str, family: str) -> PreflightInput:
    _, tp, world = FAMILY_PRESETS[family]
    return PreflightInput(
        strategy=parse_strategy(_node(family)), accelerator="gpu", tensor_parallel=tp, world_size=world, adapter=adapter
    )


def test_the_families_resolve_to_their_columns():
    for family in FAMILIES:
        _, tp, world = FAMILY_PRESETS[family]
        assert parse_strategy(_node(family)).family_at(tp, world // tp) == family


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_preflight_and_plan_refuse_exactly_the_refused_cells(adapter: str, family: str):
    refusal = adapter_cell(adapter, family)
    _, tp, world = FAMILY_PRESETS[family]
    if refusal is None:
        preflight(_input(adapter, family))  # no refusal (advice lines, if any, are not refusals)
        check_compatible(
            _node(family), "bf16-mixed", None, True, adapter=adapter, tensor_parallel=tp, data_parallel=world // tp
        )
        return
    for check in (
        lambda: preflight(_input(adapter, family)),
        lambda: check_compatible(
            _node(family), "bf16-mixed", None, True, adapter=adapter, tensor_parallel=tp, data_parallel=world // tp
        ),
    ):
        with pytest.raises(IncompatibleConfigError) as err:
            check()
        message = str(err.value)
        assert refusal.reason in message
        assert refusal.fix in message
        assert message.startswith(f"adapter='{adapter}' + strategy=")


def test_no_adapter_is_never_refused_and_the_table_says_where_each_adapter_trains():
    for family in FAMILIES:
        assert adapter_cell("none", family) is None
        preflight(_input("none", family))
    trains = {a: [f for f in FAMILIES if ADAPTER_TABLE[a][f] is None] for a in ADAPTERS}
    assert trains == {
        "lora": ["single", "ddp", "zero12", "zero3", "fsdp2", "tp", "fsdp_tp"],
        "qlora": ["single", "ddp", "fsdp2"],
    }
    assert "adapter=qlora + zero3" in refusals_markdown()


def test_adapter_kind_reads_the_group():
    from omegaconf import OmegaConf

    assert adapter_kind(OmegaConf.create({"adapter": {"kind": "qlora", "r": 8}})) == "qlora"
    assert adapter_kind(OmegaConf.create({"model": {}})) == "none"


def _lora_model(init: bool = True) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=init), model)


def test_restore_adapter_init_gives_peft_init_back_and_leaves_existing_adapters():
    model = _lora_model(init=False)  # lora_B random, as ZeRO-3's re-run owner init left it
    assert has_adapters(model)
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert all(float(p.detach().abs().sum()) > 0 for p in b)
    assert restore_adapter_init(model, existing={id(b[0])}) == 1  # the first layer's adapters existed: kept
    assert float(b[0].detach().abs().sum()) > 0
    assert float(b[1].detach().abs().sum()) == 0.0


def test_prepare_4bit_for_fsdp2_refuses_integer_storage_and_turns_off_cpu_repacking():
    import bitsandbytes as bnb

    def layer(storage: torch.dtype) -> torch.nn.Module:
        linear = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_storage=storage)
        linear.weight = bnb.nn.Params4bit(
            torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False, quant_storage=storage
        )
        linear.weight._quantize("cpu")
        return torch.nn.Sequential(linear)

    ok = layer(torch.bfloat16)
    assert prepare_4bit_for_fsdp2(ok) == 1
    assert ok[0].support_avx512bf16_for_cpu is False
    assert ok[0].quant_state is ok[0].weight.quant_state  # bitsandbytes' recovery after FSDP2's all-gather
    with pytest.raises(ConfigError, match=r"adapter.quant_storage.*uint8.*quant_storage=bfloat16"):
        prepare_4bit_for_fsdp2(layer(torch.uint8))
