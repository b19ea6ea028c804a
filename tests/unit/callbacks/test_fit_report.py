"""FitReport on a Trainer and a LightningModule of the user's own: what the printed table and the JSON contain."""

from __future__ import annotations

import io
import json

import lightning.pytorch as pl
import pytest
from rich.console import Console

from lightning_trainopt.callbacks import FitReport, MemoryBreakdown, SpeedMonitor, StepTimer
from lightning_trainopt.exceptions import ConfigError
from tests.unit.callbacks._foreign import DictClassifier, loader, padded_batches


class LoggingClassifier(DictClassifier):
    """A user's module that logs its loss under its own name."""

    def training_step(self, batch, batch_idx):
        loss = self(**batch)["loss"]
        self.log("loss", loss)
        return loss


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "figures.json"
    out = io.StringIO()
    console = Console(file=out, width=100)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer(), SpeedMonitor(), MemoryBreakdown(), FitReport(path, ("loss", "val"), console=console)],
    )
    module = LoggingClassifier()
    trainer.fit(module, loader(padded_batches(4)))
    return module, json.loads(path.read_text()), out.getvalue()


def test_the_json_holds_the_headline_and_every_reporting_callbacks_section(report):
    module, figures, _ = report
    assert figures["model"] == "LoggingClassifier"
    assert figures["n_params"] == sum(p.numel() for p in module.parameters())
    assert figures["global_step"] == 4
    assert figures["status"] == "ok"
    assert isinstance(figures["train_loss"], float)
    assert figures["val_loss"] is None  # the module logs no validation loss
    assert figures["throughput"]["tokens_per_s"] > 0
    assert figures["memory_breakdown"]["params"]["device"] == 4 * figures["n_params"]
    assert figures["step_time"]["verdict"]


def test_the_printed_table_is_train_pys(report):
    _, figures, text = report
    assert "lightning_trainopt run summary" in text
    assert f"{figures['n_params']:,}" in text
    assert "final train loss" in text
    assert "memory per rank" in text
    assert "throughput" in text
    assert "figures.json" in text


def test_loss_keys_must_be_two_names():
    with pytest.raises(ConfigError, match="loss_keys"):
        FitReport(loss_keys=("loss",))
