import json
import math

from lightning_trainopt.app.train import metrics_json


def test_metrics_json_is_strict_json_with_non_finite_as_null():
    metrics = {
        "train_loss": float("nan"),
        "non_finite": {"last_grad_norm": float("inf"), "skipped": [1.0, float("-inf")]},
        "tokens": 1024,
        "ratio": 0.5,
    }
    text = metrics_json(metrics)
    assert "NaN" not in text
    assert "Infinity" not in text
    parsed = json.loads(text)
    assert parsed == {
        "train_loss": None,
        "non_finite": {"last_grad_norm": None, "skipped": [1.0, None]},
        "tokens": 1024,
        "ratio": 0.5,
    }
    assert math.isnan(metrics["train_loss"])  # the caller's dict is left as it was
