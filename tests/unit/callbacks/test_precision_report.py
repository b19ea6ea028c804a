"""PrecisionReport: the FP8/fp32 decisions of the precision plugin reach the run summary; nothing for plain presets."""

import json

from lightning_trainopt.callbacks import PrecisionReport
from lightning_trainopt.precision import FP8PrecisionSpec, PrecisionSpec, trainer_precision_kwargs
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import tiny_data, tiny_module, tiny_trainer


@RunIf(torchao=True)
def test_fp8_fit_reports_each_layer():
    spec = FP8PrecisionSpec("fp8", "bf16-mixed", skip_small=False, keep_fp32=["RMSNorm"])
    report = PrecisionReport()
    trainer = tiny_trainer([report], max_steps=2, **trainer_precision_kwargs(spec, None, "cpu"))
    trainer.fit(tiny_module(), datamodule=tiny_data())
    summary = report.summary()["precision_layers"]
    json.dumps(summary)  # metrics.json takes it as it is
    assert (summary["backend"], summary["recipe"], summary["emulated"]) == ("torchao", "tensorwise", True)
    assert (summary["fp8_layers"], summary["bf16_layers"], summary["fp32_modules"]) == (14, 1, 5)
    head = next(layer for layer in summary["layers"] if layer["name"] == "model.lm_head")
    assert head["action"] == "bf16"
    assert "output projection" in head["reason"]


def test_plain_presets_add_nothing():
    report = PrecisionReport()
    trainer = tiny_trainer([report], max_steps=1, **trainer_precision_kwargs(PrecisionSpec("bf16", "bf16-mixed")))
    trainer.fit(tiny_module(), datamodule=tiny_data())
    assert report.summary() == {}
