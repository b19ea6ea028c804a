"""A model's linear layers in bitsandbytes' NF4, for tests of the adapter rows before the adapter core converts them."""

from __future__ import annotations

import torch
from torch import nn


def quantize_linears(model: nn.Module, double_quant: bool = True, storage: torch.dtype = torch.bfloat16) -> nn.Module:
    """Every ``nn.Linear`` but ``lm_head`` replaced by an NF4 ``Linear4bit`` (quantized by ``.to("cpu")``), in place."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=torch.float32,
                    compress_statistics=double_quant,
                    quant_type="nf4",
                    quant_storage=storage,
                )
                q.weight = bnb.nn.Params4bit(
                    child.weight.data,
                    requires_grad=False,
                    compress_statistics=double_quant,
                    quant_type="nf4",
                    quant_storage=storage,
                )
                setattr(module, name, q.to("cpu"))
    return model
