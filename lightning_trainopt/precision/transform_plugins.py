"""Precision plugins that change the model before the strategy wraps it: FP8 layers and fp32-kept modules.

Lightning runs one precision plugin per strategy, and its FP8 plugin (``TransformerEnginePrecision``) cannot be
combined with DeepSpeed or FSDP (Lightning #18679). These plugins are the strategy's own kind (``MixedPrecision`` for
single-device, DDP and FSDP2; ``DeepSpeedPrecision`` for DeepSpeed) with the model conversion added in
``convert_module``, which every strategy calls after ``configure_model`` and before it wraps the model
(``TrainOptFSDPStrategy`` calls it before ``fully_shard``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, cast

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_trainopt.precision.convert import ConversionReport, convert_model, te_recipe
from lightning_trainopt.precision.fp8_spec import FP8PrecisionSpec
from lightning_trainopt.precision.spec import PrecisionSpec

__all__ = ["ModelTransforms", "TransformDeepSpeedPrecision", "TransformMixedPrecision"]


class ModelTransforms:
    """What both plugins add: the conversion, Transformer Engine's ``fp8_autocast`` and FSDP2's scale precompute.

    Args:
        spec: the precision preset.
        device: ``cpu`` or ``cuda``, where the model runs (torchao emulates FP8 on CPU unless ``spec.emulate``).
        fsdp: FSDP2 shards the model (torchao tensorwise all-gathers FP8 weights and precomputes their scales).
    """

    def _init_transforms(self, spec: PrecisionSpec, device: str, fsdp: bool) -> None:
        self.spec = spec
        self.fsdp = fsdp
        fp8 = spec if isinstance(spec, FP8PrecisionSpec) else None
        self.emulate = bool(fp8 is not None and (fp8.emulate if fp8.emulate is not None else device == "cpu"))
        #: Filled by :meth:`transform` (``None`` before the model is converted).
        self.report: ConversionReport | None = None
        self._te_recipe: Any = None

    def transform(self, module: nn.Module) -> None:
        """Convert ``module`` in place (once; the strategies call ``convert_module`` again for each validate)."""
        if self.report is not None and module.__dict__.get("_trainopt_precision_report") is self.report:
            return
        self.report = convert_model(module, self.spec, emulate=self.emulate, fsdp=self.fsdp)
        text = self.report.text()
        if text:
            rank_zero_info(f"precision={self.spec.name}: {text}")
        warning = self.report.warning()
        if warning is not None:
            rank_zero_warn(f"precision={self.spec.name}: {warning}; this run trains without FP8.")

    @contextmanager
    def _fp8_region(self) -> Generator[None, None, None]:
        fp8 = self.spec if isinstance(self.spec, FP8PrecisionSpec) else None
        if fp8 is None or not fp8.is_te:
            yield
            return
        import transformer_engine.pytorch as te

        assert fp8.recipe is not None
        if self._te_recipe is None:
            self._te_recipe = te_recipe(fp8.recipe)
        with te.fp8_autocast(enabled=True, fp8_recipe=self._te_recipe):
            yield

    @contextmanager
    def _outside_inference_mode(self) -> Generator[None, None, None]:
        """torchao's FP8 tensors cannot run under ``torch.inference_mode`` with autocast on (``aten.to.dtype`` is not
        implemented for them; measured with torchao 0.18 on CPU): an evaluation step of an FP8 model runs under
        ``no_grad`` instead, as Lightning does for DeepSpeed and FSDP. Tensors made in inference mode can be read."""
        fp8 = self.spec if isinstance(self.spec, FP8PrecisionSpec) else None
        if fp8 is None or fp8.is_te or not torch.is_inference_mode_enabled():
            yield
            return
        with torch.inference_mode(False), torch.no_grad():
            yield

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The preset's model changes, then the Lightning plugin's own conversion (this mixin is first in the MRO)."""
        self.transform(module)
        return super().convert_module(module)  # type: ignore[misc,no-any-return]

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with super().forward_context(), self._fp8_region():  # type: ignore[misc]
            yield

    @contextmanager
    def val_step_context(self) -> Generator[None, None, None]:
        forward_context = cast(Any, self).forward_context  # the plugin class's, after this mixin in the MRO
        with self._outside_inference_mode(), forward_context():
            yield

    @contextmanager
    def test_step_context(self) -> Generator[None, None, None]:
        with self.val_step_context():
            yield

    @contextmanager
    def predict_step_context(self) -> Generator[None, None, None]:
        with self.val_step_context():
            yield

    def _after_step(self, model: nn.Module) -> None:
        if self.report is not None and self.report.fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # One all-reduce of every FP8 weight's amax per step, instead of one per weight in the next forward.
            precompute_float8_dynamic_scale_for_fsdp(model)


class TransformMixedPrecision(ModelTransforms, MixedPrecision):
    """Lightning's ``MixedPrecision`` (autocast) with the preset's model changes (single device, DDP, FSDP2).

    Args:
        spec: the precision preset (its ``trainer_precision`` is ``bf16-mixed`` or ``16-mixed``).
        device: ``cpu`` or ``cuda``.
        scaler: fp16's ``GradScaler`` (``None`` for bf16).
        fsdp: the strategy is FSDP2.

    Example::

        plugin = TransformMixedPrecision(FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed"), "cuda")
        Trainer(plugins=[plugin], strategy=TrainOptFSDPStrategy())
    """

    def __init__(
        self, spec: PrecisionSpec, device: str, scaler: torch.amp.GradScaler | None = None, fsdp: bool = False
    ) -> None:
        super().__init__(spec.trainer_precision, device, scaler=scaler)  # type: ignore[arg-type]
        self._init_transforms(spec, device, fsdp)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, model, closure, **kwargs)
        self._after_step(model)
        return out


class TransformDeepSpeedPrecision(ModelTransforms, DeepSpeedPrecision):
    """Lightning's ``DeepSpeedPrecision`` with the preset's model changes, made before the engine wraps the model.

    DeepSpeed keeps the model's parameters in bf16 (its ``bf16`` mode; the fp32 master copy is in its optimizer), so
    everything not converted to FP8 computes in bf16, as under autocast.

    Args:
        spec: the precision preset.
        device: ``cpu`` or ``cuda``.

    Example::

        plugin = TransformDeepSpeedPrecision(FP8PrecisionSpec(name="fp8", trainer_precision="bf16-mixed"), "cuda")
        Trainer(plugins=[plugin], strategy=TrainOptDeepSpeedStrategy(stage=2))
    """

    def __init__(self, spec: PrecisionSpec, device: str) -> None:
        super().__init__(spec.trainer_precision)  # type: ignore[arg-type]
        self._init_transforms(spec, device, fsdp=False)
