import json
import math
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import EarlyStopping, Timer

from lightning_trainopt.callbacks import NonFiniteGuard
from lightning_trainopt.launch.train import early_stop, metrics_json, run_status


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


@pytest.mark.parametrize(
    ("oom", "stopped_early", "train_loss", "status"),
    [
        (False, False, 2.5, "ok"),
        (False, False, None, "ok"),  # nothing logged this run, e.g. a resume at max_steps
        (False, False, float("nan"), "diverged"),
        (False, False, float("inf"), "diverged"),
        (False, True, 2.5, "stopped"),
        (False, True, float("nan"), "stopped"),  # the stop (and its reason) says more than the last loss
        (True, False, None, "oom"),
    ],
)
def test_run_status_says_what_became_of_the_fit(oom, stopped_early, train_loss, status):
    assert run_status(oom, stopped_early, train_loss) == status


def _trainer(should_stop: bool, callbacks: list, global_step: int = 5) -> SimpleNamespace:
    return SimpleNamespace(should_stop=should_stop, callbacks=callbacks, global_step=global_step)


def test_early_stop_names_the_non_finite_guard_and_its_step():
    guard = NonFiniteGuard(policy="stop")
    assert early_stop(_trainer(False, [guard])) == {"stopped_by": None, "stopped_at_step": None}
    guard.stopped_at = 4
    assert early_stop(_trainer(True, [guard])) == {"stopped_by": "NonFiniteGuard", "stopped_at_step": 4}


def test_early_stop_by_early_stopping_an_unknown_callback_or_the_time_limit():
    stopper = EarlyStopping(monitor="val_loss")
    stopper.stopped_epoch = 2
    assert early_stop(_trainer(True, [stopper], 7)) == {"stopped_by": "EarlyStopping", "stopped_at_step": 7}
    # should_stop set by a callback that keeps no record of it: still an early stop, at the step the fit ended.
    assert early_stop(_trainer(True, [NonFiniteGuard()], 3)) == {"stopped_by": None, "stopped_at_step": 3}
    # trainer.max_time reached: Lightning's Timer set should_stop, the end the config asked for.
    timer = Timer(duration={"seconds": 0})
    assert early_stop(_trainer(True, [timer], 3)) == {"stopped_by": None, "stopped_at_step": None}
