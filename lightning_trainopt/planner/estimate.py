"""One configuration in, a full per-device estimate out: model states + activations + speed + dollars."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.metrics.model_shape import GPTConfig
from lightning_trainopt.planner.activations import ActivationPolicy
from lightning_trainopt.planner.adapters import (
    AdapterPlan,
    adapter_activation_terms,
    adapter_model_states,
    dequantized_weight_term,
    lora_activation_bytes,
    qlora_activations,
)
from lightning_trainopt.planner.dp_comm import dp_comm
from lightning_trainopt.planner.model_profile import ModelProfile, gpt_param_groups, gpt_profile
from lightning_trainopt.planner.model_states import StrategyLayout, estimate_model_states
from lightning_trainopt.planner.offload_time import Bandwidths, StepOverhead, estimate_step_overhead
from lightning_trainopt.planner.optimizer_state import OPTIMIZER_STATES, OptimizerStateModel
from lightning_trainopt.planner.precision_plan import LossPlan, PrecisionPlan, fp8_transient_term, te_saved_delta
from lightning_trainopt.planner.speed import SpeedEstimate, estimate_speed
from lightning_trainopt.planner.teacher import TeacherPlan, teacher_terms
from lightning_trainopt.planner.tensor_parallel import tp_activations, tp_comm, tp_profile
from lightning_trainopt.planner.terms import MemoryEstimate
from lightning_trainopt.planner.tp_shape import TP_HF_ARCHITECTURES, TPShape

__all__ = ["PlanEstimate", "PlanInputs", "estimate_plan", "gpt_param_groups"]


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner needs, as plain values (the app builds it from the Hydra config).

    Args:
        model: the model: our transformer's shape (planned analytically) or the :class:`ModelProfile` of any
            module (``model_profile.module_profile``).
        trainer_precision: Lightning precision string.
        layout: the strategy.
        optimizer: how the optimizer stores state.
        activations: checkpointing / offload / compression policy.
        micro_batch: sequences per device per forward (``data.batch_size``).
        seq_len: tokens per sequence (``data.seq_len``).
        accumulate: gradient accumulation steps.
        devices: devices per node.
        num_nodes: nodes.
        tensor_parallel: devices of one tensor-parallel group (``ParallelDims.tp``, ``strategy.tensor_parallel_size``):
            weights split over them (``tensor_parallel``), their activations by Korthikanti's formulas, and their
            collectives charged to the step. Models with a TP plan only (our presets, Hugging Face Llama, Mistral,
            Qwen2: ``ModelProfile.tp_shape``).
        attention: ``sdpa`` or ``math``.
        adam_path: how torch Adam/AdamW runs its step (``fused``, ``foreach``, ``single_tensor``; see
            ``model_states.ADAM_PATHS``): decides the temporaries inside ``optimizer.step()``.
        precision: the preset's model changes (FP8 layers, fp32-kept modules); ``None``: none.
        loss: the loss after the output head; ``None``: logits and ``F.cross_entropy``.
        sequence_parallel: under TP, norms and the residual stream are split over the sequence too
            (``strategy.sequence_parallel``; the TP plans' default).
        replicate: HSDP replicas (``strategy.replicate``): FSDP2 shards only within each of ``replicate`` groups
            of ``data_parallel_size / replicate`` ranks and all-reduces between them.
        adapter: LoRA/QLoRA (``adapter=lora|qlora``): the base frozen (in NF4 under QLoRA), only the adapters
            trained; ``None``: every parameter trained.
        teacher: a distillation teacher (``experiment=distill``): its frozen weights, last hidden states and forward
            FLOPs are added; ``None``: none.
    """

    model: GPTConfig | ModelProfile
    trainer_precision: str = "bf16-mixed"
    layout: StrategyLayout = field(default_factory=StrategyLayout)
    optimizer: OptimizerStateModel = field(default_factory=lambda: OPTIMIZER_STATES["adamw"])
    activations: ActivationPolicy = field(default_factory=ActivationPolicy)
    micro_batch: int = 1
    seq_len: int = 2048
    accumulate: int = 1
    devices: int = 1
    num_nodes: int = 1
    tensor_parallel: int = 1
    attention: str = "sdpa"
    adam_path: str = "fused"
    precision: PrecisionPlan | None = None
    loss: LossPlan | None = None
    sequence_parallel: bool = True
    replicate: int = 1
    adapter: AdapterPlan | None = None
    teacher: TeacherPlan | None = None

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ConfigError("trainer.devices", self.devices, "plan for a positive device count (e.g. 8).")
        if self.num_nodes < 1:
            raise ConfigError("trainer.num_nodes", self.num_nodes, "use a positive node count.")
        if self.accumulate < 1:
            raise ConfigError("trainer.accumulate_grad_batches", self.accumulate, "use a positive integer.")
        for key, value in (
            ("strategy.tensor_parallel_size", self.tensor_parallel),
            ("strategy.replicate", self.replicate),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "use a positive whole number (1: none).")
        if self.world_size % (self.tensor_parallel * self.replicate):
            raise IncompatibleConfigError(
                {
                    "devices": self.world_size,
                    "strategy.tensor_parallel_size": self.tensor_parallel,
                    "strategy.replicate": self.replicate,
                },
                f"{self.world_size} devices do not split into TP {self.tensor_parallel} x {self.replicate} replicas.",
                "use sizes whose product divides trainer.devices x trainer.num_nodes.",
            )
        if self.replicate > 1 and not self.layout.shards_each_param:
            raise IncompatibleConfigError(
                {"strategy": self.layout.name, "strategy.replicate": self.replicate},
                "HSDP replicas exist for FSDP2 only (ZeRO shards over every data-parallel rank).",
                "use +strategy=fsdp_tp (FSDP2) with strategy.replicate, or strategy.replicate=1.",
            )
        if self.tensor_parallel > 1:
            if self.layout.wraps_in_engine or self.layout.offloads_params:
                raise IncompatibleConfigError(
                    {"strategy": self.layout.name, "strategy.tensor_parallel_size": self.tensor_parallel},
                    "tensor parallelism runs under FSDP2 (fsdp_tp) or alone (tp), not under DeepSpeed or offload.",
                    "use +strategy=fsdp_tp strategy.tensor_parallel_size=K, or tensor_parallel_size=1.",
                )
            if self.tp_shape is None:
                name = self.profile.name
                raise ConfigError(
                    "strategy.tensor_parallel_size",
                    self.tensor_parallel,
                    f"tensor parallelism has no plan for {name} (plans exist for our GPT presets and Hugging Face "
                    f"{', '.join(TP_HF_ARCHITECTURES)} models, by module name), so the planner cannot say what it "
                    "would split; plan this model with tensor_parallel_size=1 (FSDP2 / ZeRO-3 shard any model).",
                )

    @property
    def world_size(self) -> int:
        """Devices of the job (``devices`` x ``num_nodes``): what is billed."""
        return self.devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """Replicas that read distinct samples (``world_size / tensor_parallel``): the global batch is
        ``micro_batch`` x ``accumulate`` x this, and ZeRO/FSDP shard over it."""
        return self.world_size // self.tensor_parallel

    @property
    def shard_size(self) -> int:
        """Ranks ZeRO/FSDP2 shard the model states over: the data-parallel ranks of one HSDP replica group."""
        return self.data_parallel_size // self.replicate

    @property
    def profile(self) -> ModelProfile:
        """The model as the planner reads it (our transformer's analytic profile for a :class:`GPTConfig`)."""
        if isinstance(self.model, ModelProfile):
            return self.model
        loss = self.loss if self.loss is not None and self.loss.kind != "standard" else None
        return gpt_profile(self.model, loss)

    @property
    def tp_shape(self) -> TPShape | None:
        """What tensor parallelism splits of the model (``None``: no plan for it)."""
        return self.profile.tp_shape

    @property
    def compute_bytes(self) -> int:
        return 4 if self.trainer_precision in ("32-true", "64-true") else 2

    @property
    def autocast(self) -> bool:
        # Lightning hands DeepSpeed a half-precision module instead of autocasting.
        return self.trainer_precision.endswith("-mixed") and not self.layout.wraps_in_engine


@dataclass(frozen=True)
class PlanEstimate:
    """The planner's answer for one configuration.

    Args:
        inputs: what was planned.
        memory: itemised per-device bytes.
        speed: step time, tokens/s and dollars.
        device_memory_bytes: memory of one device (``None`` when unknown).
        train_flops_per_token: FLOPs the hardware executes per token (recomputation included).
        headroom_bytes: device memory kept free for what the planner does not count (CUDA context, NCCL buffers,
            allocator fragmentation); ``fits`` needs the peak to fit in the rest.
        host_memory_bytes: host RAM of one node (``None`` when unknown): the offloaded bytes of the node's ranks
            must fit in it, less the same headroom fraction (each rank's process, its CUDA context and data loader
            workers, which the planner does not count).
        headroom_fraction: the share of device and host memory kept free.
        device_is_host: the "device" is the CPU (planning for ``hardware=cpu``/``auto`` on a CPU machine): its peak is
            host RAM too, and counts in ``host_bytes_per_node``.
    """

    inputs: PlanInputs
    memory: MemoryEstimate
    speed: SpeedEstimate
    device_memory_bytes: int | None
    train_flops_per_token: float
    headroom_bytes: int = 0
    host_memory_bytes: int | None = None
    headroom_fraction: float = 0.0
    device_is_host: bool = False

    @property
    def total_device_bytes(self) -> int:
        """Sum of every category (as if all coexisted): the conservative figure."""
        return self.memory.bytes()

    @property
    def peak_device_bytes(self) -> int:
        """Predicted peak: what lives all step + the larger of the backward phase and the optimizer-step phase."""
        return self.memory.peak()

    @property
    def device_fits(self) -> bool | None:
        """Whether the predicted peak fits the device's memory less the headroom (``None`` when unknown)."""
        if self.device_memory_bytes is None:
            return None
        return self.peak_device_bytes <= self.device_memory_bytes - self.headroom_bytes

    @property
    def host_bytes_per_node(self) -> int:
        """Host RAM the ranks of one node take: per-rank CPU bytes, or the model built in host memory if larger (plus
        the device peak when the device is the CPU) x devices per node."""
        device = self.peak_device_bytes if self.device_is_host else 0
        return (self.memory.held("cpu") + device) * self.inputs.devices

    @property
    def host_usable_bytes(self) -> int | None:
        """Host RAM of one node less the headroom fraction (``None`` when unknown)."""
        if self.host_memory_bytes is None:
            return None
        return self.host_memory_bytes - int(self.headroom_fraction * self.host_memory_bytes)

    @property
    def host_fits(self) -> bool | None:
        """Whether the node's offloaded bytes fit its usable host RAM (``None``: RAM unknown and something is
        offloaded; ``True`` when nothing is)."""
        if not self.host_bytes_per_node:
            return True
        usable = self.host_usable_bytes
        return None if usable is None else self.host_bytes_per_node <= usable

    @property
    def fits(self) -> bool | None:
        """Whether the configuration fits: the device peak fits the device, and the offloaded bytes the host.

        ``False`` when either is known not to fit; ``None`` when the device memory is unknown.
        """
        if self.host_fits is False:
            return False
        return self.device_fits

    @property
    def margin_bytes(self) -> int | None:
        """Usable memory (device memory less headroom) left over at the predicted peak; negative: does not fit."""
        if self.device_memory_bytes is None:
            return None
        return self.device_memory_bytes - self.headroom_bytes - self.peak_device_bytes


def estimate_plan(
    inputs: PlanInputs,
    device_memory_bytes: int | None,
    peak_flops: float | None,
    price_per_device_hour: float | None,
    hfu: float | None = None,
    target_tokens: float = 1e9,
    measured_tokens_per_sec_per_device: float | None = None,
    headroom_fraction: float = 0.0,
    host_memory_bytes: int | None = None,
    device_is_host: bool = False,
    bandwidths: Bandwidths | None = None,
    mfu: float | None = None,
    fp8_peak_flops: float | None = None,
) -> PlanEstimate:
    """Estimate memory, speed and cost of one configuration.

    Args:
        inputs: the configuration.
        device_memory_bytes: memory of one device.
        peak_flops: dense peak FLOP/s of one device in the compute dtype.
        price_per_device_hour: dollars per device-hour.
        hfu: assumed fraction of the peak sustained on the FLOPs executed (hardware FLOPs utilisation); default 0.4.
        target_tokens: tokens to train, for time and dollars to target.
        measured_tokens_per_sec_per_device: a measured figure that replaces the FLOPs model.
        headroom_fraction: share of the device memory kept free (CUDA context, NCCL, fragmentation), in [0, 1);
            the same share of the host RAM is kept free for the ranks' processes.
        host_memory_bytes: host RAM of one node, for the verdict on offloaded bytes (``None``: unknown).
        device_is_host: the planned device is the CPU: its peak counts against the host RAM too.
        bandwidths: PCIe, device memory, NVMe and CPU Adam rates that charge offload and int8 compression
            (``offload_time``); ``None`` or a missing rate leaves that item uncharged and named in
            ``speed.overhead.not_charged``.
        mfu: the former name of ``hfu`` (the fraction always applied to the executed FLOPs).
        fp8_peak_flops: dense FP8 peak FLOP/s of one device, for the FLOPs of the layers ``inputs.precision``
            converts (``None``: no FP8 peak, e.g. a CPU that emulates FP8: they run at ``peak_flops``).

    Raises:
        ConfigError: ``headroom_fraction`` outside [0, 1); both ``hfu`` and ``mfu`` given.
    """
    if not 0 <= headroom_fraction < 1:
        raise ConfigError("plan.headroom_fraction", headroom_fraction, "use a fraction in [0, 1), e.g. 0.05.")
    if mfu is not None and hfu is not None:
        raise ConfigError("mfu", mfu, "give hfu only (mfu is its former name).")
    hfu = mfu if mfu is not None else (0.4 if hfu is None else hfu)
    tp = inputs.tensor_parallel
    # One rank's share of the model under TP (matrices / tp), then sharded over one replica group's ranks.
    m = tp_profile(inputs.profile, tp)
    adapter, teacher = inputs.adapter, inputs.teacher
    if adapter is not None:
        states = adapter_model_states(
            adapter,
            inputs.trainer_precision,
            inputs.layout,
            inputs.optimizer,
            inputs.shard_size,
            tensor_parallel=tp,
            accumulate=inputs.accumulate,
            adam_path=inputs.adam_path,
            fsdp_units=m.fsdp_units,
        )
    else:
        states = estimate_model_states(
            m.param_groups,
            inputs.trainer_precision,
            inputs.layout,
            inputs.optimizer,
            inputs.shard_size,
            accumulate=inputs.accumulate,
            adam_path=inputs.adam_path,
            module_trace=m.module_trace,
            fsdp_units=m.fsdp_units,
        )
    model_flops, recompute_flops = m.flops(inputs.micro_batch, inputs.seq_len)
    every = inputs.activations.checkpoint_every
    n_ckpt = 0 if every == 0 or not m.n_blocks else -(-m.n_blocks // every)
    fraction = n_ckpt / m.n_blocks if m.n_blocks else 0.0
    acts = _activations(inputs, m, fraction)
    tokens = inputs.micro_batch * inputs.seq_len
    if adapter is not None:
        acts = qlora_activations(acts, adapter, fraction)
        extra = lora_activation_bytes(adapter, tokens, inputs.compute_bytes)
        # Saved inside the blocks: checkpointed blocks keep only their input, so their adapters save nothing. Whole
        # model's bytes: tp_activations below splits them over a TP group with the rest.
        acts = acts + MemoryEstimate.of(adapter_activation_terms(adapter, extra, fraction, m.n_blocks))
        if adapter.quantized:
            acts = acts + MemoryEstimate.of([dequantized_weight_term(adapter, inputs.compute_bytes, tp)])
        model_flops += adapter.flops_delta(tokens)
    if teacher is not None:
        states = states + teacher_terms(teacher, inputs.compute_bytes, inputs.layout, inputs.shard_size, tokens, tp)
        # The teacher's forward is work done (MFU counts it) and time spent.
        model_flops += int(teacher.forward_flops_per_token * tokens)
    if tp > 1:
        assert inputs.tp_shape is not None  # PlanInputs refuses TP for models without a plan
        acts = tp_activations(
            acts, inputs.tp_shape, inputs.micro_batch, inputs.seq_len, tp, inputs.sequence_parallel, inputs.attention
        )
    hw_flops = model_flops + int(round(fraction * recompute_flops))
    per_token = hw_flops / tokens
    p = inputs.precision
    # The converted layers' share of the model FLOPs; the recomputed forward is taken at the same share.
    fp8_share = min(1.0, p.fp8_flops_per_token * tokens / model_flops) if p is not None and p.fp8 else 0.0
    memory = states + acts
    overhead = estimate_step_overhead(
        memory,
        # What the optimizer steps (and whose gradients go to the host): with an adapter, its parameters only.
        n_params=inputs.adapter.n_adapter if inputs.adapter is not None else m.n_params,
        world_size=inputs.shard_size,
        devices_per_node=inputs.devices,
        accumulate=inputs.accumulate,
        layout=inputs.layout,
        activations=inputs.activations,
        compute_bytes=inputs.compute_bytes,
        bandwidths=bandwidths or Bandwidths(),
        device_is_host=device_is_host,
    )
    if tp > 1:
        assert inputs.tp_shape is not None
        bw = bandwidths or Bandwidths()
        comm = tp_comm(
            inputs.tp_shape,
            inputs.micro_batch,
            inputs.seq_len,
            inputs.accumulate,
            inputs.compute_bytes,
            tp,
            inputs.sequence_parallel,
            inputs.devices,
            n_ckpt,
            bw.nvlink_bytes_per_s,
            bw.network_bytes_per_s,
        )
        item = f"TP collectives ({comm.link})"
        if comm.seconds is None:
            overhead = replace(overhead, not_charged=(*overhead.not_charged, f"{item}: {comm.formula}"))
        else:
            overhead = replace(
                overhead,
                serial={**overhead.serial, item: comm.seconds},
                formulas={**overhead.formulas, item: comm.formula},
            )
    if not device_is_host:
        overhead = _charge_dp_comm(overhead, inputs, m.n_params, bandwidths or Bandwidths())
    speed = estimate_speed(
        per_token,
        # A TP group computes its replica's tokens together: each rank does 1/tp of their FLOPs.
        inputs.micro_batch * inputs.seq_len * inputs.accumulate / tp,
        inputs.world_size,
        peak_flops,
        hfu,
        price_per_device_hour,
        target_tokens,
        measured_tokens_per_sec_per_device,
        overhead,
        fp8_share,
        fp8_peak_flops,
        emulated=p is not None and p.emulated,
    )
    headroom = int(headroom_fraction * device_memory_bytes) if device_memory_bytes else 0
    return PlanEstimate(
        inputs,
        memory,
        speed,
        device_memory_bytes,
        per_token,
        headroom,
        host_memory_bytes,
        headroom_fraction,
        device_is_host,
    )


def _charge_dp_comm(overhead: StepOverhead, inputs: PlanInputs, n_params: int, bw: Bandwidths) -> StepOverhead:
    """``overhead`` with the data-parallel collectives of one step (``dp_comm``): beside compute or waited for."""
    # Weights travel as held: fp32 under autocast and in fp32, half for -true and in DeepSpeed's half engine.
    w = 4 if inputs.autocast or inputs.compute_bytes == 4 else 2
    trainable, gathered = None, None
    adapter = inputs.adapter
    if adapter is not None:
        # Gradients of the adapters only (a TP rank holds 1/tp of them, as of the base); the whole base is gathered
        # under ZeRO-3/FSDP2, its NF4 layers as their packed bytes.
        tp = max(1, inputs.tensor_parallel)
        trainable = -(-adapter.n_adapter // tp)
        quantized = sum(adapter.quantized)
        packed, _ = adapter.nf4()
        gathered = ((n_params - quantized // tp) * w + packed / tp) + trainable * w
    comms = dp_comm(
        inputs.layout,
        n_params,
        w,
        w,
        inputs.data_parallel_size,
        inputs.replicate,
        inputs.tensor_parallel,
        inputs.devices,
        inputs.accumulate,
        bw.nvlink_bytes_per_s,
        bw.network_bytes_per_s,
        trainable=trainable,
        gathered_bytes=gathered,
    )
    for c in comms:
        if c.seconds is None:
            overhead = replace(overhead, not_charged=(*overhead.not_charged, f"{c.label}: {c.formula}"))
            continue
        formulas = {**overhead.formulas, c.label: c.formula}
        if c.overlapped:
            overhead = replace(overhead, overlapped={**overhead.overlapped, c.label: c.seconds}, formulas=formulas)
        else:
            overhead = replace(overhead, serial={**overhead.serial, c.label: c.seconds}, formulas=formulas)
    return overhead


def _activations(inputs: PlanInputs, m: ModelProfile, checkpointed: float) -> MemoryEstimate:
    """The activations of one micro-batch: the profile's, or measured under the precision preset's conversion (FP8
    with torchao, fp32-kept modules), or derived for Transformer Engine; plus the FP8 casts of one layer."""
    args = (
        inputs.micro_batch,
        inputs.seq_len,
        inputs.compute_bytes,
        inputs.autocast,
        inputs.activations,
        inputs.attention,
    )
    p = inputs.precision
    if p is not None and p.measure is not None:
        measured = p.measure(inputs.loss.kind if inputs.loss is not None else "standard")(*args)
        assert isinstance(measured, MemoryEstimate)
        acts = measured
    else:
        acts = m.activations(*args)
    tokens = inputs.micro_batch * inputs.seq_len
    if p is not None and p.fp8 and p.measure is None and p.backend == "transformer_engine":
        # Only the layers of blocks that keep their activations save anything (checkpointed blocks keep their input).
        delta = te_saved_delta(p, tokens, inputs.compute_bytes)
        acts = acts + MemoryEstimate.of([replace(delta, nbytes=int(round(delta.nbytes * (1 - checkpointed))))])
    transient = fp8_transient_term(p, tokens) if p is not None and p.fp8 else None
    return acts + MemoryEstimate.of([transient]) if transient is not None else acts
