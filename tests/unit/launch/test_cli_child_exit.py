"""A rank Lightning started leaves without the interpreter's teardown once its job is done; rank 0 does not."""

from __future__ import annotations

import pytest

from lightning_trainopt.launch import cli


class _Exited(Exception):
    pass


def _fake_exit(code):
    raise _Exited(code)


@pytest.mark.parametrize(("local_rank", "leaves"), [("1", True), ("3", True), ("0", False), (None, False)])
def test_only_a_child_rank_leaves_with_os_exit(monkeypatch, local_rank, leaves):
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(cli.os, "_exit", _fake_exit)
    if leaves:
        with pytest.raises(_Exited) as err:
            cli.leave_child_rank()
        assert err.value.args == (0,)
    else:
        cli.leave_child_rank()


def test_train_main_leaves_after_the_job(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "run_hydra", lambda task, name: calls.append(name))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cli.os, "_exit", _fake_exit)
    with pytest.raises(_Exited):
        cli.train_main()
    assert calls == ["train"]
