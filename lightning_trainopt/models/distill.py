"""Knowledge distillation: a student LightningModule that learns from a frozen teacher submodule.

The student is the module ``model=...`` builds as usual (:class:`~lightning_trainopt.models.LitGPT` or
:class:`~lightning_trainopt.models.LitCausalLM`), so whatever applies to the student (an adapter, activation
checkpointing, compile) applies to it alone. :class:`DistillGPT` / :class:`DistillCausalLM` add ``self.teacher``:

- built in ``configure_model``, inside the strategy's init context, so it is built like the student (on the meta
  device under FSDP2/TP, partitioned under ZeRO-3) and the strategies shard it like the student (FSDP2 shards its
  blocks and then it as one unit, with the strategy's ``reshard_after_forward``); its weights are read in
  ``on_fit_start``, after the strategy placed it (whole, per ZeRO-3 partition or per FSDP2 shard);
- frozen (``requires_grad=False``: the optimizer never sees it, so it has no optimizer state), kept in eval mode,
  run under ``torch.no_grad``; under ``bf16-mixed``/``16-mixed`` on one device or DDP it is stored in the compute
  dtype (it has no master weights to keep in fp32);
- not saved: ``on_save_checkpoint`` drops its tensors from the state dict and records its path and fingerprint;
  ``on_load_checkpoint`` refuses a teacher whose fingerprint differs and puts the live teacher's tensors back so that
  the strict load of the student succeeds.

The loss is :class:`~lightning_trainopt.transforms.distill_loss.DistillHeadLoss` as the student's head loss: the
teacher's forward runs first and leaves its hidden states and (gathered) head weight; the student's head then
computes the chunked loss. ``train/ce`` and ``train/kl`` (and ``val/ce``, ``val/kl``) are logged beside
``train_loss`` (the distillation objective); ``val_loss`` is the student's cross-entropy, comparable with a run
without a teacher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torchmetrics import MeanMetric

from lightning_trainopt._compat.lightning_internals import module_trainer
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.metrics.flops import teacher_forward_flops
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT
from lightning_trainopt.models.hf import LitCausalLM
from lightning_trainopt.models.hf_config import HFModelConfig, import_transformers
from lightning_trainopt.models.lit_gpt import LitGPT
from lightning_trainopt.models.optimization import strategy_answers
from lightning_trainopt.transforms.chunked_loss import DEFAULT_CHUNK_TOKENS, forward_replaced, head_weight
from lightning_trainopt.transforms.distill_loss import DistillHeadLoss, TeacherOutputs, check_distill_args

__all__ = [
    "TEACHER_RECORD",
    "DistillCausalLM",
    "DistillGPT",
    "DistillSpec",
    "TeacherSource",
    "build_teacher_model",
    "load_full_state",
]

_TEACHER = "teacher."
#: The checkpoint entry where a distilled student records its teacher (path and fingerprint).
TEACHER_RECORD = "distill_teacher"


@dataclass(frozen=True)
class DistillSpec:
    """The ``distill`` group (``experiment=distill``).

    Args:
        teacher: the teacher: one of our checkpoints (a Lightning ``.ckpt`` file, a DeepSpeed ZeRO checkpoint
            directory, an FSDP2/TP DCP directory) or a local Hugging Face model directory (``config.json`` and
            safetensors).
        teacher_model: the teacher's shape when the checkpoint does not say it (a model node: ``GPTConfig`` fields
            or ``HFModelConfig``); ``None``: from the checkpoint's hyper-parameters or the HF directory.
        alpha: weight of the KL term: ``(1 - alpha) * CE + alpha * T^2 * KL``.
        temperature: softmax temperature ``T`` of the KL term.
        kind: ``forward`` KL(teacher || student) or ``reverse`` KL(student || teacher).
        chunk_tokens: tokens projected through both heads at a time.
    """

    teacher: str
    teacher_model: GPTConfig | HFModelConfig | None = None
    alpha: float = 0.5
    temperature: float = 2.0
    kind: str = "forward"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        check_distill_args(self.alpha, self.temperature, self.kind, self.chunk_tokens)
        if not isinstance(self.teacher, str) or not self.teacher:
            raise ConfigError("distill.teacher", self.teacher, "give the path of a checkpoint or a HF model directory.")


@dataclass(frozen=True)
class TeacherSource:
    """Where the teacher comes from, resolved before training (``checkpoint.teacher.teacher_source``).

    Args:
        path: ``distill.teacher`` as given.
        config: the teacher's shape.
        fingerprint: a hash of the teacher's files, recorded in the student's checkpoints and checked on resume.
        load_state: returns the teacher's whole state dict, keyed like the plain model's (``GPT`` or the HF model).
        vocab_size: token ids the teacher embeds.
    """

    path: str
    config: GPTConfig | HFModelConfig
    fingerprint: str
    load_state: Callable[[], Mapping[str, torch.Tensor]]
    vocab_size: int


def load_full_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], partitioned: bool) -> None:
    """Copy a whole state dict into ``model``, wherever its parameters are: whole, ZeRO-3 partitions or DTensors.

    Raises:
        ConfigError: the state lacks a tensor of the model or has one it does not know (key ``distill.teacher``).
    """
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    persistent = set(model.state_dict())
    missing = [n for n in names if n in persistent and n not in state]
    unexpected = [k for k in state if k not in persistent]
    if missing or unexpected:
        raise ConfigError(
            "distill.teacher",
            f"{len(missing)} missing / {len(unexpected)} unexpected tensors",
            f"the teacher's weights do not match its model (missing e.g. {missing[:3]}, unexpected e.g. "
            f"{unexpected[:3]}); give distill.teacher_model the teacher run's model node.",
        )
    if partitioned:
        import deepspeed

        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.copy_(state[name].to(param.dtype))
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name not in state:
                continue
            value = state[name]
            if isinstance(tensor, DTensor):
                value = distribute_tensor(value.to(tensor.dtype), tensor.device_mesh, tensor.placements)
            tensor.copy_(value.to(dtype=tensor.dtype, device=tensor.device))


def _whole(weight: torch.Tensor, sharded: bool) -> torch.Tensor:
    """The head weight as it is in the head's call, made to outlive it (FSDP2/ZeRO-3 free their gather after it).

    A tensor-parallel teacher's head stays a DTensor sharded over the vocabulary: the student's loss is
    vocabulary-parallel too and each rank only needs its rows (a clone of them under FSDP2 x TP).
    """
    return weight.detach().clone() if sharded else weight.detach()


@contextlib.contextmanager
def _head_returns_input(head: torch.nn.Module, sharded: bool, into: dict[str, Any]) -> Iterator[None]:
    """While inside, ``head(hidden)`` returns ``hidden`` and leaves the head's whole weight (and bias) in ``into``."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        into["weight"] = _whole(head_weight(head, "distill"), sharded)
        bias = getattr(head, "bias", None)
        into["bias"] = None if bias is None else _whole(bias, sharded)
        from torch.distributed.tensor import DTensor

        # A tensor-parallel head's input is replicated over the group (ColwiseParallel's input hook): its local
        # tensor is the whole one, returned plain so that the head's output hook lets it through unsharded.
        return hidden.to_local() if isinstance(hidden, DTensor) else hidden

    with forward_replaced(head, forward):
        yield


def build_teacher_model(config: GPTConfig | HFModelConfig) -> torch.nn.Module:
    """The teacher's model of ``config``, constructed on the current default device (the meta device for a shape).

    The distilling module builds it so in ``configure_model``; pre-flight (``config/distill.py``) on the meta device
    to check it against the tensor-parallel size before anything is spawned.
    """
    if isinstance(config, GPTConfig):
        return GPT(config)
    hf_config = config.load()
    hf_config.use_cache = False
    auto = import_transformers().AutoModelForCausalLM
    model: torch.nn.Module = auto.from_config(hf_config, attn_implementation=config.attn_implementation)
    return model


class _Distillation:
    """What the two distilling LightningModules add to their student class (a mixin; see the module docstring)."""

    teacher: torch.nn.Module | None
    head_loss: Any
    distill_source: TeacherSource
    distill: DistillSpec
    log: Callable[..., Any]
    batch_size_of: Callable[[Any], int]

    def _init_distillation(self, source: TeacherSource, spec: DistillSpec) -> None:
        self.distill_source, self.distill = source, spec
        self.head_loss = DistillHeadLoss(spec.alpha, spec.temperature, spec.kind, spec.chunk_tokens)  # type: ignore[arg-type]
        self.teacher = None
        self._teacher_loaded = False
        self.val_ce, self.val_kl = MeanMetric(), MeanMetric()

    # The LightningModule hooks, once for both students: ``super()`` is the student class (LitGPT or LitCausalLM),
    # the next one after this mixin in the distilling class's MRO.
    def configure_model(self) -> None:
        super().configure_model()  # type: ignore[misc]
        self._build_teacher(self.build_dtype)  # type: ignore[attr-defined]  # the student class's (LitLanguageModel)

    def train(self, mode: bool = True) -> Any:
        super().train(mode)  # type: ignore[misc]
        if self.teacher is not None:
            self.teacher.eval()  # Lightning puts the whole module in train mode at fit start
        return self

    def on_fit_start(self) -> None:
        self.load_teacher()

    def batch_loss(self, batch: Any) -> Any:
        return self._distill_batch_loss(batch, super().batch_loss)  # type: ignore[misc]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = super().training_step(batch, batch_idx)  # type: ignore[misc]
        self._log_terms(batch)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._distill_validation_step(batch)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # type: ignore[misc]
        self._log_val_terms()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._save_without_teacher(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._load_with_teacher(checkpoint)

    def _build_teacher(self, build_dtype: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
        if self.teacher is not None:
            return
        with build_dtype():
            teacher = build_teacher_model(self.distill_source.config)
        teacher.requires_grad_(False)
        teacher.eval()
        self.teacher = teacher

    def _teacher_head(self) -> torch.nn.Module:
        assert self.teacher is not None
        if isinstance(self.teacher, GPT):
            return self.teacher.lm_head
        head: torch.nn.Module = self.teacher.get_output_embeddings()  # type: ignore[operator]
        return head

    def _sharded_teacher(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return self._partitioned() or any(isinstance(m, FSDPModule) for m in self.teacher.modules())  # type: ignore[union-attr]

    def _partitioned(self) -> bool:
        answers = strategy_answers(self)  # type: ignore[arg-type]
        return answers is not None and answers.builds_partitioned

    def load_teacher(self) -> None:
        """Read the teacher's weights into it (once), wherever the strategy put its parameters."""
        if self._teacher_loaded or self.teacher is None:
            return
        load_full_state(self.teacher, self.distill_source.load_state(), self._partitioned())
        from torch.distributed.tensor import DTensor

        trainer = module_trainer(self)
        precision = str(trainer.precision) if trainer is not None else ""
        half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        plain = not self._partitioned() and not any(isinstance(p, DTensor) for p in self.teacher.parameters())
        if half is not None and plain:
            # No optimizer, no master weights: the teacher is kept in the dtype autocast computes in.
            self.teacher.to(half)
        self._teacher_loaded = True

    def teacher_outputs(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None) -> TeacherOutputs:
        """The teacher's hidden states of a batch and its whole head weight, without gradients."""
        assert self.teacher is not None
        if not self._teacher_loaded:
            self.load_teacher()
        got: dict[str, Any] = {}
        with torch.no_grad(), _head_returns_input(self._teacher_head(), self._sharded_teacher(), got):
            if isinstance(self.teacher, GPT):
                hidden = self.teacher(input_ids)
            else:
                hidden = self.teacher(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        from torch.distributed.tensor import DTensor

        if isinstance(hidden, DTensor):  # a tensor-parallel teacher's replicated output
            hidden = hidden.full_tensor()
        return TeacherOutputs(hidden.detach(), got["weight"], got.get("bias"))

    def _distill_batch_loss(self, batch: Any, student_loss: Callable[[Any], Any]) -> Any:
        if isinstance(batch, dict):
            outputs = self.teacher_outputs(batch["input_ids"], batch.get("attention_mask"))
        else:
            outputs = self.teacher_outputs(batch[0])
        with self.head_loss.teacher_batch(outputs):
            return student_loss(batch)

    def _log_terms(self, batch: Any) -> None:
        terms = self.head_loss.last
        if terms is not None:
            n = self.batch_size_of(batch)
            self.log("train/ce", terms.ce, batch_size=n)
            self.log("train/kl", terms.kl, batch_size=n)

    def _distill_validation_step(self, batch: Any) -> torch.Tensor:
        loss, tokens = self.batch_loss(batch)  # type: ignore[attr-defined]
        terms = self.head_loss.last
        # val_loss is the student's cross-entropy, comparable with any other run's (and what checkpoints monitor);
        # the distillation objective is train_loss, its KL term val/kl.
        self.val_mean.update(terms.ce.float(), weight=tokens)  # type: ignore[attr-defined]
        self.val_ce.update(terms.ce.float(), weight=tokens)
        self.val_kl.update(terms.kl.float(), weight=tokens)
        return loss  # type: ignore[no-any-return]

    def _log_val_terms(self) -> None:
        for name, metric in (("val/ce", self.val_ce), ("val/kl", self.val_kl)):
            if metric.update_count:
                self.log(name, metric.compute(), sync_dist=True)
            metric.reset()

    def _save_without_teacher(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):
            for key in [k for k in state if k.startswith(_TEACHER)]:
                del state[key]
        checkpoint[TEACHER_RECORD] = {"path": self.distill_source.path, "fingerprint": self.distill_source.fingerprint}

    def _load_with_teacher(self, checkpoint: dict[str, Any]) -> None:
        record = checkpoint.get(TEACHER_RECORD)
        if record is not None and record.get("fingerprint") != self.distill_source.fingerprint:
            raise ConfigError(
                "distill.teacher",
                self.distill_source.path,
                f"is not the teacher this run was trained with ({record.get('path')}, fingerprint "
                f"{str(record.get('fingerprint'))[:12]}); resume with that teacher, or start a new run "
                "(ckpt_path=null).",
            )
        state = checkpoint.get("state_dict")
        if isinstance(state, dict) and self.teacher is not None:
            # The checkpoint holds no teacher: the strict load of the student gets the live teacher's tensors.
            state.update({_TEACHER + k: v for k, v in self.teacher.state_dict().items()})

    @contextlib.contextmanager
    def excluded_from_checkpoint(self) -> Iterator[None]:
        """While inside, the module has no teacher: a sharded checkpoint (DCP) is loaded into the student alone."""
        teacher = self.teacher
        if teacher is None:
            yield
            return
        delattr(self, "teacher")
        try:
            yield
        finally:
            self.teacher = teacher

    def teacher_forward_flops(self, samples: int, seq_len: int) -> int:
        """The teacher's forward FLOPs for a ``(samples, seq_len)`` batch: work SpeedMonitor's MFU counts."""
        cfg = self.distill_source.config
        if isinstance(cfg, GPTConfig):
            return teacher_forward_flops(samples, seq_len, config=cfg)
        assert self.teacher is not None
        n = sum(int(getattr(p, "ds_numel", p.numel())) for p in self.teacher.parameters())
        return teacher_forward_flops(samples, seq_len, n_params=n)

    def distill_summary(self) -> dict[str, Any]:
        """The run summary's ``distill`` entry (metrics.json)."""
        teacher_params = (
            sum(int(getattr(p, "ds_numel", p.numel())) for p in self.teacher.parameters()) if self.teacher else None
        )
        return {
            "teacher": self.distill_source.path,
            "teacher_fingerprint": self.distill_source.fingerprint,
            "teacher_params": teacher_params,
            **{k: v for k, v in asdict(self.distill).items() if k not in ("teacher", "teacher_model")},
        }


class DistillGPT(_Distillation, LitGPT):
    """:class:`~lightning_trainopt.models.LitGPT` (the student) distilled from a frozen teacher.

    Args:
        model: the student's shape.
        teacher: where the teacher comes from.
        distill: the loss settings.
        optimizer: a factory ``params -> Optimizer`` (it only sees the student's parameters).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` or ``None``.

    Example::

        module = DistillGPT(GPTConfig(n_layers=2), teacher_source("runs/big/last.ckpt", None), DistillSpec("..."))
    """

    def __init__(
        self,
        model: GPTConfig | dict[str, Any],
        teacher: TeacherSource,
        distill: DistillSpec,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> None:
        LitGPT.__init__(self, model, optimizer=optimizer, scheduler=scheduler)
        self._init_distillation(teacher, distill)


class DistillCausalLM(_Distillation, LitCausalLM):
    """:class:`~lightning_trainopt.models.LitCausalLM` (the student, ``model=hf``) distilled from a frozen teacher.

    Args:
        model: where the student comes from.
        teacher: where the teacher comes from.
        distill: the loss settings.
        optimizer: a factory ``params -> Optimizer`` (it only sees the student's parameters).
        scheduler: a factory ``(optimizer, total_steps=...) -> LRScheduler`` or ``None``.
    """

    def __init__(
        self,
        model: HFModelConfig | dict[str, Any],
        teacher: TeacherSource,
        distill: DistillSpec,
        optimizer: Any = None,
        scheduler: Any = None,
    ) -> None:
        spec_loss = DistillHeadLoss(distill.alpha, distill.temperature, distill.kind, distill.chunk_tokens)  # type: ignore[arg-type]
        # Passing the loss checks the student's logits are the head's (no soft-capping the loss would skip).
        LitCausalLM.__init__(self, model, optimizer=optimizer, scheduler=scheduler, loss=spec_loss)
        self._init_distillation(teacher, distill)
