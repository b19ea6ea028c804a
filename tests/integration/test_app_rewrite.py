"""The app applies ``activations=`` (and ``compile``) through the ordered model rewrite, once, before on_fit_start."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

import lightning_trainopt.callbacks.activation_checkpointing as ac_module
import lightning_trainopt.parallel.apply as apply_module
from lightning_trainopt.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_trainopt.config.rewrite import install_app_rewrites
from lightning_trainopt.launch.train import train
from lightning_trainopt.transforms.checkpointing import is_checkpointed
from tests.helpers.compose import TINY, compose_config


def test_train_app_checkpoints_once_before_the_callbacks_on_fit_start(tmp_path, monkeypatch):
    calls: list[str] = []
    seen_at_fit_start: list[int] = []

    def counting(where: str, real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(where)
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        apply_module, "apply_activation_checkpointing", counting("rewrite", apply_module.apply_activation_checkpointing)
    )
    monkeypatch.setattr(
        ac_module, "apply_activation_checkpointing", counting("callback", ac_module.apply_activation_checkpointing)
    )
    own = ActivationCheckpointing.on_fit_start

    def on_fit_start(self: ActivationCheckpointing, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seen_at_fit_start.append(sum(1 for m in pl_module.modules() if is_checkpointed(m)))
        own(self, trainer, pl_module)

    monkeypatch.setattr(ActivationCheckpointing, "on_fit_start", on_fit_start)
    cfg = compose_config(
        [*TINY, "trainer.max_steps=2", "data=synthetic", "callbacks=none", "activations=checkpoint"], tmp_path
    )
    metrics = train(cfg)
    assert metrics["status"] == "ok"
    # Both blocks were already checkpointed when the callback's on_fit_start ran; only the rewrite patched them.
    assert seen_at_fit_start == [2]
    assert calls == ["rewrite"]
    assert metrics["activation_checkpointing"]["wrapped"] == 2
    assert metrics["activation_checkpointing"]["candidates"] == 2
    assert 0 < metrics["activation_checkpointing"]["recomputed_fraction"] <= 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp2_run_rewrites_in_the_documented_order(tmp_path, monkeypatch):
    """conversions < checkpointing < compile < fully_shard, recorded on a 1-process FSDP2 fit (gloo, CPU)."""
    from lightning_trainopt.config.build import _instantiate_named
    from lightning_trainopt.config.model_factory import build_lightning_module
    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.parallel.spec import precision_needs
    from lightning_trainopt.precision.plugins import trainer_precision_kwargs

    order: list[str] = []

    def recording(step: str, real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            order.append(step)
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(apply_module, "_convert_by_plugin", recording("convert", apply_module._convert_by_plugin))
    monkeypatch.setattr(
        apply_module,
        "apply_activation_checkpointing",
        recording("checkpoint", apply_module.apply_activation_checkpointing),
    )
    # Recorded, not compiled: inductor on this CPU would take minutes; what is tested is where the step runs.
    monkeypatch.setattr(apply_module, "compile_model", lambda model, **kw: order.append("compile") or [])
    monkeypatch.setattr(apply_module, "apply_fully_shard", recording("shard", apply_module.apply_fully_shard))
    cfg = compose_config(
        [
            *TINY,
            "trainer.max_steps=2",
            "data=synthetic",
            "callbacks=none",
            "activations=checkpoint",
            "precision=fp8",
            "+strategy=fsdp",
            "trainer.devices=1",
            "trainer.accelerator=cpu",
        ],
        tmp_path,
    )
    from hydra.utils import instantiate

    from lightning_trainopt.config.run_spec import run_spec

    module = build_lightning_module(cfg)
    activations = _instantiate_named(run_spec(cfg).transforms.nodes)
    install_app_rewrites(module, activations, compile_model=True)
    precision = run_spec(cfg).precision
    strategy = build_strategy(cfg.strategy, precision, cfg.trainer)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=activations,
        **trainer_precision_kwargs(precision, precision_needs(strategy), "cpu"),
    )
    trainer.fit(module, datamodule=instantiate(cfg.data))
    assert order.index("convert") < order.index("checkpoint") < order.index("compile") < order.index("shard")
    assert order.count("checkpoint") == 1
    assert apply_module.rewrite_report(module).steps == ["convert", "activations", "compile"]


def test_train_app_int8_compresses_through_the_rewritten_training_step(tmp_path):
    cfg = compose_config(
        [*TINY, "trainer.max_steps=2", "data=synthetic", "callbacks=none", "activations=int8"], tmp_path
    )
    metrics = train(cfg)
    assert metrics["status"] == "ok"
    # The callback installed no hook (report-only); its counters are the rewrite's transform's.
    assert metrics["activation_compression"]["compressed_storages"] > 0


@pytest.mark.slow
def test_a_head_loss_with_compile_under_fsdp2_trains_as_without_compile(tmp_path):
    """compile leaves the head eager (blocks only), so the head loss runs inside FSDP2's unit: no longer refused."""
    import json
    import subprocess
    import sys

    from tests.helpers.compose import REPO_ROOT

    proc = subprocess.run(
        [
            sys.executable, "train.py", "-m", "trainer=ddp_sim", "+strategy=fsdp", "loss=chunked_ce",
            "compile=false,true", *TINY, "data=synthetic", "callbacks=none", f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    runs = {}
    for path in tmp_path.glob("*/metrics.json"):
        overrides = (path.parent / ".hydra" / "overrides.yaml").read_text()
        runs["compile=true" in overrides.lower()] = json.loads(path.read_text())
    assert set(runs) == {False, True}, proc.stderr[-3000:]
    assert all(m["status"] == "ok" and m["world_size"] == 2 for m in runs.values())
    for key in ("train_loss", "val_loss"):
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-4), key
