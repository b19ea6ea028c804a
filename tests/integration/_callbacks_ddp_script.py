"""Run exported callbacks on 2 CPU processes; each rank writes its summaries to OUT/rank{r}.json.

Usage: python tests/integration/_callbacks_ddp_script.py OUT_DIR [NAME,NAME,...] [STRATEGY] [MODEL]
  NAME,...: callbacks to run (default: every export); STRATEGY: ``ddp`` (default) or a preset of conf/strategy
  (``zero3``, ``fsdp``, ...), built by the app's builder with small buckets and every ZeRO-3 parameter partitioned;
  MODEL: ``ours`` (default: the tiny LitGPT on token tensors) or ``foreign`` (a module that is not ours: Hugging
  Face style dict batches with padding and varying lengths, ``forward(**inputs)``, its own loss), ``hf_llama`` or
  ``hf_gpt2`` (a tiny transformers ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` in an ordinary LightningModule, padded
  causal-LM dict batches; see tests/helpers/hf.py).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


import lightning_trainopt.callbacks as cbs  # noqa: E402
from lightning_trainopt.launch.multirun import teardown_distributed  # noqa: E402
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer  # noqa: E402

# On CPU the finder needs a byte budget (it refuses to guess one).
KWARGS = {"MicroBatchFinder": {"budget_bytes": 200_000_000}}


def _strategy(name: str, ours: bool = True) -> object:
    if name == "ddp":
        return "ddp"
    from omegaconf import OmegaConf

    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.precision import PrecisionSpec

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    node = OmegaConf.load(os.path.join(root, "lightning_trainopt", "conf", "strategy", f"{name}.yaml"))
    # The tiny model's matrices are below the preset's persistence threshold: partition them all so the per-rank
    # figures show ZeRO-3 sharding; CPU-sized buckets.
    small = {"param_persistence_threshold": 0, "allgather_bucket_size": 200_000, "reduce_bucket_size": 200_000}
    for key, value in small.items():
        if key in node:
            node[key] = value
    if "shard_modules" in node and not ours:
        node.shard_modules = None  # FSDP2 shards a module that is not ours by its own repeated block
    spec = PrecisionSpec(name="fp32", trainer_precision="32-true")
    return build_strategy(node, spec, {"accumulate_grad_batches": 1, "gradient_clip_val": None}, micro_batch_size=4)


def main(out: str, names: list[str], strategy: str = "ddp", model: str = "ours") -> None:
    warnings.simplefilter("ignore")
    kwargs = dict(KWARGS)
    if strategy.startswith("zero"):
        # DeepSpeed steps its own gradient partitions: the guard's skip cannot drop them, so it is refused there.
        kwargs["NonFiniteGuard"] = {"policy": "stop"}
    callbacks = [getattr(cbs, name)(**kwargs.get(name, {})) for name in names]
    trainer = tiny_trainer(callbacks, max_steps=4, devices=2, strategy=_strategy(strategy, model == "ours"))
    if model == "foreign":
        from tests.unit.callbacks._foreign import DictClassifier, loader, padded_batches

        # 8 batches: Lightning's DistributedSampler gives each rank 4, one per optimizer step.
        trainer.fit(DictClassifier(), loader(padded_batches(8)))
    elif model.startswith("hf_"):
        from tests.helpers.hf import hf_batches, hf_module, loader

        trainer.fit(hf_module(model.removeprefix("hf_")), loader(hf_batches(8)))
    else:
        trainer.fit(tiny_module(), tiny_data())
    summaries = {type(cb).__name__: cb.summary() for cb in callbacks}
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as fh:
        json.dump({"global_step": trainer.global_step, "world_size": trainer.world_size, "summaries": summaries}, fh)
    teardown_distributed()  # exiting with the gloo group alive can abort while its threads are torn down


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else list(cbs.__all__),
        sys.argv[3] if len(sys.argv) > 3 else "ddp",
        sys.argv[4] if len(sys.argv) > 4 else "ours",
    )
