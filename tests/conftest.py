"""Fixtures every test gets: a clean environment, no leftover process group, no leftover Hydra config."""

from __future__ import annotations

import logging
import os

import pytest
import torch

# Every model in the tests is tiny and many tests run 2 training processes on the 2-core machine, where a second
# OpenMP thread per process oversubscribes the cores. Measured 2026-12-02 (gpt_tiny, 2 x 32 tokens, fwd+bwd+AdamW):
# alone, 13 ms/step with 1 thread and 11 ms with 2; two processes side by side, 13 ms each with 1 thread and 32 ms
# each with 2. Set before any test builds a model, and inherited by every train.py, plan.py and worker subprocess;
# an OMP_NUM_THREADS already in the environment wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests whose ``RunIf`` needs a CUDA device get the ``cuda`` marker (``pytest -m cuda`` on a GPU machine)."""
    for item in items:
        if any(mark.kwargs.get("needs_cuda") for mark in item.iter_markers(name="skipif")):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(autouse=True)
def _lightning_logs_reach_caplog():
    """Lightning's log records reach pytest's ``caplog`` whichever test imported Lightning first.

    ``lightning.pytorch`` gives itself a console handler and stops propagating when it is first imported while the
    root logger has no handler: in a test run that happens or not depending on the order of the tests, and a test
    reading a callback's ``rank_zero_info`` line with ``caplog`` then passed alone and failed after another file.
    """
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).propagate = True


def _restored_environment():
    env = dict(os.environ)
    yield
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


_restore_environment = pytest.fixture(autouse=True)(_restored_environment)
# Around each module too: a module-scoped fixture runs before the per-test snapshot above, so what it leaves (a
# seed_everything's PL_GLOBAL_SEED, which Lightning's strategies re-seed from in ranks spawned later) would reach the
# next module's spawned workers.
_restore_environment_per_module = pytest.fixture(autouse=True, scope="module")(_restored_environment)


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def _builtin_linear_after_zero3():
    """A test that enters ``deepspeed.zero.Init`` leaves DeepSpeed's linear in ``torch.nn.functional`` (as a sweep job
    does in its process, which ``launch.multirun.teardown_distributed`` undoes); the next test gets torch's own."""
    yield
    from lightning_trainopt._compat.torch_internals import restore_builtin_linear

    restore_builtin_linear()


@pytest.fixture(autouse=True)
def _reset_hydra():
    yield
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None
    GlobalHydra.instance().clear()
