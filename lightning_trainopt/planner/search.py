"""``plan.search=true``: enumerate configurations, drop those that do not fit, rank by dollars per token.

Dollars follow the step time, which charges offload copies, CPU Adam, NVMe swaps and int8 compression
(``offload_time``), TP collectives and the data-parallel collectives that do not hide behind compute (``dp_comm``).
Configurations that still cost the same (the time model does not see kernel efficiency) are ranked by memory
margin, largest first: the one least likely to run out of memory; then by fewer moving parts. Within one
configuration the micro-batch with the fewest dollars, then the largest (fewest accumulation steps), is its row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import product

from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.planner.activations import ActivationPolicy
from lightning_trainopt.planner.adapters import AdapterPlan
from lightning_trainopt.planner.estimate import PlanEstimate, PlanInputs
from lightning_trainopt.planner.model_states import StrategyLayout
from lightning_trainopt.planner.optimizer_state import OptimizerStateModel
from lightning_trainopt.planner.precision_plan import LossPlan, PrecisionPlan
from lightning_trainopt.planner.tensor_parallel import tp_refusal

__all__ = [
    "TP_STRATEGY",
    "Candidate",
    "Parallelism",
    "SearchSpace",
    "best_per_configuration",
    "least_parallelism",
    "rank_candidates",
    "search_plans",
    "simplicity",
]

#: The strategy preset of FSDP2 with tensor parallelism or HSDP replicas (``conf/strategy/fsdp_tp.yaml``).
TP_STRATEGY = "fsdp_tp"

# Ties on dollars and margin go to the configuration with fewer moving parts: this order, then fewer bytes.
_SIMPLICITY = ("none", "single", "ddp", "zero1", "zero2", "fsdp", "zero3", "offload", "infinity")


@dataclass(frozen=True)
class SearchSpace:
    """The options to combine, each keyed by the preset name the winning command will use.

    Args:
        precisions: preset name -> Lightning precision string.
        strategies: preset name -> layout.
        activations: preset name -> policy.
        optimizers: preset name -> state model.
        micro_batches: micro-batch sizes to try; the global batch of the base plan is held fixed.
        precision_plans: preset name -> its model changes (FP8 layers, fp32-kept modules); a preset not in it
            changes nothing.
        losses: preset name -> loss, when the search chooses the loss too (``plan.search_space.loss``); empty: the
            base plan's loss, and no ``loss`` choice.
        tensor_parallel: TP sizes to try with FSDP2 (``plan.search_space.tensor_parallel``); sizes larger than a
            node's devices, not dividing the world, or not dividing the model's heads, KV heads, FFN width,
            vocabulary and sequence length are skipped (TP belongs inside a node).
        replicate: HSDP replica counts to try with FSDP2 (``plan.search_space.replicate``); those not dividing the
            data-parallel ranks are skipped.
        adapters: preset name -> adapter (``None``: train every weight), when the user lets the search train through
            an adapter (``plan.adapters=true``: an adapter changes what is trained); empty: the base plan's adapter,
            and no ``adapter`` choice.
    """

    precisions: Mapping[str, str]
    strategies: Mapping[str, StrategyLayout]
    activations: Mapping[str, ActivationPolicy]
    optimizers: Mapping[str, OptimizerStateModel]
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    precision_plans: Mapping[str, PrecisionPlan | None] = field(default_factory=dict)
    losses: Mapping[str, LossPlan] = field(default_factory=dict)
    tensor_parallel: tuple[int, ...] = (1,)
    replicate: tuple[int, ...] = (1,)
    adapters: Mapping[str, AdapterPlan | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """One enumerated configuration and its estimate.

    Args:
        choices: group -> preset name (``precision``, ``strategy``, ``activations``, ``optimizer``).
        estimate: the planner's answer.
        reason: one line saying why it ranks where it does.
    """

    choices: dict[str, str]
    estimate: PlanEstimate
    reason: str = ""


def simplicity(name: str) -> int:
    """Rank of a strategy preset name in the tie-break order (``none`` < ``ddp`` < ``zero1`` < ... < ``infinity``)."""
    for i, key in enumerate(reversed(_SIMPLICITY)):
        if key in name:
            return len(_SIMPLICITY) - 1 - i
    return len(_SIMPLICITY)


def _act_rank(policy: ActivationPolicy) -> int:
    """Rank of an activation policy in the tie-break order: none < every 2nd < checkpoint < int8 < offload."""
    if policy.offload:
        return 4
    if policy.compress_bits:
        return 3
    return {0: 0, 1: 2}.get(policy.checkpoint_every, 1)


def _cost(c: Candidate) -> float:
    """Dollars per 1B tokens, or minus tokens/s without a price (both: less is better), to 9 decimals."""
    s = c.estimate.speed
    return round(s.usd_per_1b_tokens if s.usd_per_1b_tokens is not None else -(s.tokens_per_sec_per_device or 0.0), 9)


def _margin(c: Candidate) -> int:
    return c.estimate.margin_bytes if c.estimate.margin_bytes is not None else 0


def _configuration(c: Candidate) -> tuple[tuple[str, str], ...]:
    i = c.estimate.inputs
    dims = (("replicate", str(i.replicate)), ("tensor_parallel", str(i.tensor_parallel)))
    return tuple(sorted(c.choices.items())) + dims


def _reason(c: Candidate, best: Candidate | None, tied: int) -> str:
    e = c.estimate
    mem = e.memory.per_device()
    biggest = max(("params", "grads", "optimizer_states", "activations"), key=lambda k: mem[k])
    head = f"{biggest} largest"
    if e.margin_bytes is not None:
        head += f", {e.margin_bytes / 2**30:.1f} GiB spare"
    overhead = e.speed.overhead
    if overhead is not None and e.speed.compute_s is not None and e.speed.step_time_s is not None:
        extra_s = e.speed.step_time_s - e.speed.compute_s
        if extra_s > 0:
            head += f", +{extra_s:.3g} s/step beyond compute"
    if best is None or e.speed.usd_per_1b_tokens is None or best.estimate.speed.usd_per_1b_tokens is None:
        return head
    extra = e.speed.usd_per_1b_tokens / best.estimate.speed.usd_per_1b_tokens - 1
    if c is best:
        return f"{head}; cheapest" + (f", most margin of {tied} at this price" if tied > 1 else "")
    return f"{head}; {extra:+.0%} $" + ("" if abs(extra) > 1e-9 else " (less margin)")


def rank_candidates(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Sort fitting candidates: fewest dollars per 1B tokens (or most tokens/s without a price); among configurations
    at the same price, the larger memory margin of the configuration's best micro-batch, then the simpler; within a
    configuration, the larger micro-batch."""
    fitting = [c for c in candidates if c.estimate.fits is not False]

    def variant(c: Candidate) -> tuple[float, int, int]:
        return (_cost(c), -c.estimate.inputs.micro_batch, c.estimate.total_device_bytes)

    row: dict[tuple[tuple[str, str], ...], Candidate] = {}
    for c in fitting:
        config = _configuration(c)
        if config not in row or variant(c) < variant(row[config]):
            row[config] = c

    def order(c: Candidate) -> tuple[float, int, int, int, int, tuple[float, int, int]]:
        best, i = row[_configuration(c)], c.estimate.inputs
        return (
            _cost(c),
            -_margin(best),
            simplicity(c.choices.get("strategy", "")),
            _act_rank(i.activations),
            int(i.optimizer.bits != 32),
            variant(c),
        )

    ranked = sorted(fitting, key=order)
    best = ranked[0] if ranked else None
    tied = len({_configuration(c) for c in ranked if best is not None and _cost(c) == _cost(best)})
    return [replace(c, reason=_reason(c, best, tied)) for c in ranked]


def best_per_configuration(ranked: Iterable[Candidate]) -> list[Candidate]:
    """One row per configuration (its ``choices``: precision, strategy, activations, optimizer), at its best
    micro-batch and accumulation: the first of its variants in ``ranked``, which keeps its rank.

    The micro-batch only splits the same global batch differently, so a ranking of every variant would fill its top
    rows with one configuration at each micro-batch that fits.
    """
    seen: set[tuple[tuple[str, str], ...]] = set()
    out = []
    for c in ranked:
        key = _configuration(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _check_micro_batches(micro_batches: tuple[int, ...], base: PlanInputs) -> None:
    """Refuse micro-batches that cannot be searched, instead of enumerating nothing.

    Raises:
        ConfigError: an empty list, a micro-batch that is not a positive whole number, or none that divides the
            sequences each device processes per optimizer step (the global batch is held).
    """
    key = "plan.search_space.micro_batch"
    given = list(micro_batches)
    if not given or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in given):
        raise ConfigError(key, given, "use positive whole micro-batch sizes, e.g. [1, 2, 4].")
    per_device = base.micro_batch * base.accumulate
    if all(per_device % b for b in given):
        divisors = [d for d in range(1, per_device + 1) if per_device % d == 0]
        raise ConfigError(
            key,
            given,
            f"the search holds the global batch of {per_device * base.data_parallel_size} sequences (data.batch_size "
            f"{base.micro_batch} x trainer.accumulate_grad_batches {base.accumulate} x {base.data_parallel_size} "
            "data-parallel devices) and "
            f"none of these divides the {per_device} per device; use divisors of {per_device}: {divisors}.",
        )


def search_plans(
    base: PlanInputs,
    space: SearchSpace,
    estimate: Callable[[PlanInputs], PlanEstimate],
    adam_path_for: Callable[[PlanInputs], str] | None = None,
    allowed: Callable[[dict[str, str], PlanInputs], bool] | None = None,
) -> tuple[list[Candidate], int]:
    """Enumerate the space around ``base`` (model, devices, sequence length and global batch kept).

    Args:
        base: the user's configuration.
        space: the options.
        estimate: ``inputs -> PlanEstimate`` with the hardware bound in.
        adam_path_for: ``inputs -> adam_path``, how torch Adam runs its step for a candidate (fused, foreach under
            DeepSpeed on CUDA, ...); ``None`` keeps ``base.adam_path``.
        allowed: ``(choices, inputs) -> bool``, whether ``train.py`` accepts the combination (the app passes the
            pre-flight rules, so the search enumerates exactly what training runs); ``None`` allows all.

    Returns:
        (fitting candidates ranked best first, every micro-batch of a configuration its own candidate; number
        enumerated). :func:`best_per_configuration` keeps each configuration's best micro-batch.
    """
    global_seqs = base.micro_batch * base.accumulate * base.data_parallel_size
    _check_micro_batches(space.micro_batches, base)
    out: list[Candidate] = []
    n = 0
    losses: dict[str | None, LossPlan | None] = {None: base.loss}
    if space.losses:
        losses = dict(space.losses.items())
    adapters: dict[str | None, AdapterPlan | None] = {None: base.adapter}
    if space.adapters:
        adapters = dict(space.adapters.items())
    for (pn, prec), (sn, lay), (an, act), (on, opt), (ln, loss), (dn, adapter), mb, tp, r in product(
        space.precisions.items(),
        space.strategies.items(),
        space.activations.items(),
        space.optimizers.items(),
        losses.items(),
        adapters.items(),
        space.micro_batches,
        space.tensor_parallel,
        space.replicate,
    ):
        if not _dims_apply(base, lay, tp, r):
            continue
        dp = base.world_size // tp
        if global_seqs % (mb * dp):
            continue
        if lay.ddp_buckets and base.world_size == 1:
            continue
        choices = {"precision": pn, "strategy": sn, "activations": an, "optimizer": on}
        if ln is not None:
            choices["loss"] = ln
        if dn is not None:
            choices["adapter"] = dn
        inputs = replace(
            base,
            trainer_precision=prec,
            layout=lay,
            activations=act,
            optimizer=opt,
            micro_batch=mb,
            accumulate=global_seqs // (mb * dp),
            precision=space.precision_plans.get(pn),
            loss=loss,
            tensor_parallel=tp,
            replicate=r,
            adapter=adapter,
        )
        if adam_path_for is not None:
            inputs = replace(inputs, adam_path=adam_path_for(inputs))
        if allowed is not None and not allowed(choices, inputs):
            continue
        if (tp, r) != (1, 1):
            # FSDP2 with TP or HSDP replicas is the fsdp_tp strategy (strategy.tensor_parallel_size, .replicate).
            choices = {**choices, "strategy": TP_STRATEGY}
            inputs = replace(inputs, layout=replace(lay, name=TP_STRATEGY))
        n += 1
        out.append(Candidate(choices, estimate(inputs)))
    return rank_candidates(out), n


def _dims_apply(base: PlanInputs, layout: StrategyLayout, tp: int, replicate: int) -> bool:
    """Whether TP ``tp`` and ``replicate`` HSDP replicas are a candidate for ``layout`` around ``base``: FSDP2 without
    offload, TP inside a node and dividing what a Megatron-style plan splits, both dividing the world."""
    if (tp, replicate) == (1, 1):
        return True
    if not layout.shards_each_param or layout.offloads_params or layout.offloads_optimizer:
        return False
    if base.world_size % (tp * replicate) or tp > base.devices:
        return False
    shape = base.tp_shape
    if tp > 1 and (shape is None or tp_refusal(shape, tp, base.seq_len, True)):
        return False
    return base.world_size // tp > 1 or replicate == 1


@dataclass(frozen=True)
class Parallelism:
    """The least parallelism the model needs: the lowest rung of the design articles' ladder with a fitting candidate.

    Args:
        rung: 0 data parallel (DDP: nothing sharded), 1 + ZeRO-1/2 (optimizer states and gradients sharded),
            2 ZeRO-3 / FSDP2 (parameters sharded too), 3 ZeRO-3/FSDP2 + TP, 4 offload to CPU/NVMe, 5 nothing fits.
        name: the rung in words (``ZeRO-3 + TP 8``).
        candidate: the best-ranked fitting candidate on that rung (``None`` when nothing fits).
        without_recompute: the rung was found among candidates that keep every activation (no checkpointing,
            compression or offload); ``False``: only with one of them.
        message: one line for the report.
    """

    rung: int
    name: str
    candidate: Candidate | None
    without_recompute: bool
    message: str


_RUNGS = ("data parallel (DDP)", "ZeRO-1/2", "ZeRO-3 / FSDP2", "ZeRO-3 / FSDP2 + TP", "offload to CPU/NVMe")


def _rung(c: Candidate) -> tuple[int, int]:
    i = c.estimate.inputs
    lay = i.layout
    if lay.offloads_optimizer or lay.offloads_params:
        return 4, i.tensor_parallel
    if i.tensor_parallel > 1:
        return 3, i.tensor_parallel
    if lay.shards_params:
        return 2, 1
    if lay.shards_optimizer:
        return 1, 1
    return 0, 1


def least_parallelism(ranked: Iterable[Candidate], max_tp: int) -> Parallelism:
    """The lowest rung of DDP < ZeRO-1/2 < ZeRO-3/FSDP2 < + TP (smallest TP first) < offload with a fitting candidate,
    preferring candidates that keep all activations (recomputation and activation offload trade speed for memory;
    the articles' regimes are about where the model states and activations fit).

    Args:
        ranked: the search's fitting candidates, best first (:func:`search_plans`).
        max_tp: the largest TP size the search tried (at most a node's devices), for the message when nothing fits.
    """
    fitting = [c for c in ranked if c.estimate.fits is not False]
    for keep_all in (True, False):
        pool = [c for c in fitting if not keep_all or _keeps_all(c)]
        if pool:
            best = min(pool, key=_rung)  # min is stable: the best-ranked of the lowest rung
            rung, tp = _rung(best)
            name = _RUNGS[rung] + (f" {tp}" if rung == 3 else "")
            how = "" if keep_all else " (only with activation checkpointing, compression or offload)"
            return Parallelism(rung, name, best, keep_all, f"least parallelism that fits: {name}{how}")
    tried = f"ZeRO-3 / FSDP2 + TP {max_tp} inside a node" if max_tp > 1 else "ZeRO-3 / FSDP2 (no TP size searched)"
    message = (
        f"nothing fits, not even {tried}: the model states and activations per device exceed its memory at this "
        "world size. More nodes (FSDP shards over them), or pipeline parallelism (not built in lightning_trainopt), "
        "would be needed."
    )
    return Parallelism(5, "pipeline parallelism or more nodes", None, False, message)


def _keeps_all(c: Candidate) -> bool:
    a = c.estimate.inputs.activations
    return a.checkpoint_every == 0 and not a.offload and not a.compress_bits
