"""LightningModule around a Hugging Face causal LM built from local files."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.hf_config import HFModelConfig, import_transformers
from lightning_trainopt.models.lit_lm import HeadLoss, LitLanguageModel
from lightning_trainopt.models.optimization import OptimizerFactory, strategy_answers
from lightning_trainopt.transforms.chunked_loss import head_returns_loss
from lightning_trainopt.transforms.compile import compile_model

__all__ = ["LitCausalLM"]

IGNORE_INDEX = -100  # Hugging Face's (and torch's cross_entropy's) label of a position without a target


#: Config fields of architectures whose logits are changed after the output head (Gemma 2's soft-capping, Cohere's
#: and Granite's scaling): a loss that applies the head itself would skip that.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _check_plain_logits(hf_config: Any, loss: Any) -> None:
    for field in _LOGIT_POSTPROCESSING:
        if getattr(hf_config, field, None) not in (None, 1, 1.0):
            raise ConfigError(
                "loss",
                type(loss).__name__,
                f"{hf_config.model_type} changes its logits after the head ({field}="
                f"{getattr(hf_config, field)}), which this loss would skip; use loss=standard for this model.",
            )


def _building_partitioned(module: LitLanguageModel) -> bool:
    """The module is being built partitioned (DeepSpeed ZeRO-3's ``zero.Init``): its strategy's answer."""
    answers = strategy_answers(module)
    return answers is not None and answers.builds_partitioned


def _saved_tensors(weights: Path) -> dict[str, Path]:
    """``{tensor name: file}`` of a ``save_pretrained`` directory (one file, or shards listed in an index)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (weights / index).is_file():
            weight_map = json.loads((weights / index).read_text())["weight_map"]
            return {name: weights / file for name, file in weight_map.items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (weights / single).is_file():
            path = weights / single
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    return dict.fromkeys(f.keys(), path)
            return dict.fromkeys(torch.load(path, map_location="meta", weights_only=True), path)
    return {}


def _read_tensor(path: Path, name: str) -> torch.Tensor:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[name]


def _load_partitioned(model: torch.nn.Module, weights: Path) -> None:
    """Copy the saved weights into ZeRO-3 partitioned parameters, one parameter gathered at a time (rank 0's copy is
    re-partitioned to all ranks), so no rank ever holds the whole model.

    Raises:
        ConfigError: the directory lacks a parameter of the model (a checkpoint of another architecture).
    """
    import deepspeed

    files = _saved_tensors(weights)
    missing = [name for name, _ in model.named_parameters() if name not in files]
    if missing:
        raise ConfigError(
            "model.pretrained",
            str(weights),
            f"the saved weights lack {len(missing)} parameter(s) of the model, e.g. {missing[0]}; point it at a "
            "checkpoint of this architecture (saved by save_pretrained).",
        )
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(_read_tensor(files[name], name).to(param.dtype))


class LitCausalLM(LitLanguageModel):
    """Next-token language modelling with any Hugging Face causal LM (``AutoModelForCausalLM``).

    The Hugging Face model is built in ``configure_model``, inside the strategy's init context (DeepSpeed ZeRO-3
    creates it partitioned), and kept as ``self.model`` (compiled in place, so it stays the ``PreTrainedModel``). Its
    KV cache is off: training never reuses it, and a recomputed forward under activation checkpointing would append
    to it again. Batches are our data's ``(x, y)`` pairs (``y`` the next tokens of ``x``) or dicts
    ``{input_ids, attention_mask, labels}`` (``labels`` -100 on padding; without ``labels`` the inputs, masked).

    Args:
        model: where the model comes from (an :class:`HFModelConfig` or its fields as a dict).
        optimizer: a factory ``params -> Optimizer`` (a Hydra partial); default AdamW(lr=3e-4).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` (a Hydra partial) or ``None``.
        compile_model: ``torch.compile`` each decoder layer in place
            (:func:`~lightning_trainopt.transforms.compile.compile_model`; ``train.py`` compiles through its model
            rewrite instead and leaves this ``False``).

    Example::

        module = LitCausalLM(HFModelConfig(config="tiny_llama/config.json", overrides={"num_hidden_layers": 2}))
    """

    def __init__(
        self,
        model: HFModelConfig | dict[str, Any],
        optimizer: OptimizerFactory | None = None,
        scheduler: Callable[..., Any] | None = None,
        compile_model: bool = False,
        loss: HeadLoss | None = None,
    ) -> None:
        super().__init__(optimizer, scheduler, compile_model, loss)
        self.spec = model if isinstance(model, HFModelConfig) else HFModelConfig(**model)
        self.hf_config = self.spec.load()
        self.hf_config.use_cache = False
        if loss is not None:
            _check_plain_logits(self.hf_config, loss)
        self.save_hyperparameters({"model": asdict(self.spec), "compile_model": compile_model})

    @property
    def model_type(self) -> str:
        """The Hugging Face ``model_type`` (``llama``, ``gpt2``, ...)."""
        return str(self.hf_config.model_type)

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds."""
        return int(self.hf_config.vocab_size)

    @override
    def configure_model(self) -> None:
        """Build the model (or load the local weights), in the dtype its strategy keeps (:meth:`build_dtype`)."""
        if self.model is not None:
            return
        transformers = import_transformers()
        auto = transformers.AutoModelForCausalLM
        attn = self.spec.attn_implementation
        weights = self.spec.weights_dir()
        # On the meta device (a planner's copy, or FSDP2's meta build: each rank then reads its slices of the files,
        # pretrained_files) there is nothing to load; under ZeRO-3 the model is built partitioned
        # and the weights are copied in one gathered parameter at a time (from_pretrained would write whole tensors
        # into the empty placeholders).
        on_meta = torch.empty(0).device.type == "meta"
        with self.build_dtype():
            if weights is None or on_meta or _building_partitioned(self):
                model = auto.from_config(self.hf_config, attn_implementation=attn)
            else:
                model = auto.from_pretrained(
                    str(weights), config=self.hf_config, attn_implementation=attn, local_files_only=True
                )
        if weights is not None and not on_meta and _building_partitioned(self):
            _load_partitioned(model, weights)
            # The weights are the checkpoint's: the strategy's re-run of the model's init must leave them.
            model._trainopt_initialized = True
        model.config.use_cache = False
        if self.compile_model:
            # In place, block by block (the head stays eager): the one way this package compiles.
            compile_model(model)
        self.model = model

    def pretrained_files(self) -> tuple[torch.nn.Module, dict[str, Path]] | None:
        """``(the Hugging Face model, {tensor name: file})`` of ``model.pretrained`` for a model built on the meta
        device that a sharding strategy fills slice by slice; ``None`` without ``model.pretrained``."""
        weights = self.spec.weights_dir()
        if weights is None or self.model is None:
            return None
        return self.model, _saved_tensors(weights)

    @override
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> Any:
        assert self.model is not None
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)

    def _head_loss(self, input_ids: torch.Tensor, mask: torch.Tensor | None, shift: bool, targets: torch.Tensor) -> Any:
        """The configured head + loss on the backbone's last hidden states (``shift``: drop the last position)."""
        model: Any = self.model
        assert model is not None
        assert self.head_loss is not None
        head = model.get_output_embeddings()
        # The model's forward computes the loss where it would compute the logits (see head_returns_loss): inside the
        # head's call and inside the FSDP2 unit that holds it (compile leaves the head eager: compile_model).
        with head_returns_loss(head, self.head_loss, targets, shift):
            return model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    @override
    def batch_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | int]:
        if not isinstance(batch, dict):
            x, y = batch
            if self.head_loss is not None:
                return self._head_loss(x, None, False, y), y.numel()
            logits = self(x).logits
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.reshape(-1)), y.numel()
        input_ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        labels = batch.get("labels")
        if labels is None:
            labels = input_ids if mask is None else input_ids.masked_fill(mask == 0, IGNORE_INDEX)
        # Position t predicts label t + 1: the first label of each row is predicted by nothing.
        tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        if self.head_loss is not None:
            return self._head_loss(input_ids, mask, True, labels[:, 1:]), tokens
        out = self(input_ids, attention_mask=mask, labels=labels)
        return out.loss, tokens
