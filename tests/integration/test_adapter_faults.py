"""Faults met by ``adapter=lora`` and ``experiment=distill`` runs, through ``train()`` and ``trainopt-export``'s
``main`` in this process: a full disk while saving and while exporting, a truncated checkpoint, a crashed run
resumed at another length, a resume whose command builds another adapter, base or teacher, and exports of what is
no adapter run.

Two runs in one folder need no test here: ``train.py`` locks ``hydra.run.dir`` before it composes the config
(``launch/cli.py`` ``run_hydra``), so the refusal cannot depend on the run's kind; the plain test
(test_checkpoint_faults.py) covers every kind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from lightning_trainopt.checkpoint.adapter_state import ADAPTER_KEY
from lightning_trainopt.checkpoint.export import main as export_main
from lightning_trainopt.checkpoint.verify import checkpoint_problem
from lightning_trainopt.exceptions import CheckpointWriteError, ConfigError, TrainOptError
from lightning_trainopt.launch.train import train
from tests.helpers.compose import TINY, compose_config
from tests.helpers.hf_files import write_pretrained
from tests.helpers.tmpfs import resize_tmpfs, small_tmpfs

# Checkpoints every 2 steps (last.ckpt, and the best by val_loss at step 2 beside it); no monitors.
CKPT = ["callbacks=[model_checkpoint]", "+callbacks.model_checkpoint.every_n_train_steps=2"]
LORA = [*TINY, *CKPT, "adapter=lora"]
CRASH = ["+callbacks.crash._target_=tests.helpers.crash.CrashAt", "+callbacks.crash.step=3"]
STEP_TOKENS = 4 * 32  # data.batch_size x data.seq_len of TINY


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _export_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        export_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run that crashed at step 3, after its checkpoints of step 2: what a killed job leaves behind.

    One test resumes it in place; the others copy it or read it, and any of its checkpoints serves them."""
    run_dir = tmp_path_factory.mktemp("crashed")
    with pytest.raises(RuntimeError, match="injected crash at step 3"):
        train(compose_config([*LORA, *CRASH], run_dir))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(ckpts) == 2, ckpts
    assert "last.ckpt" in ckpts
    return run_dir


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain (full fine-tuning) run of 2 steps: a distillation teacher, and a run folder without an adapter."""
    run_dir = tmp_path_factory.mktemp("teacher")
    metrics = train(compose_config([*TINY, *CKPT, "trainer.max_steps=2"], run_dir))
    assert metrics["status"] == "ok"
    return run_dir


def test_a_truncated_last_ckpt_is_named_or_skipped_and_the_crashed_run_resumes_at_another_length(crashed):
    # In place: Lightning's ModelCheckpoint keeps writing last.ckpt only in the folder it saved it in (a moved
    # folder gets last-v1.ckpt). The other tests copy or only read the run, and any of its checkpoints serves them.
    run_dir = crashed
    last = run_dir / "checkpoints" / "last.ckpt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])  # a write cut short outside our atomic writer (a copy, a sync)

    # Given by name it is refused, named, before anything runs; as for a plain run.
    with pytest.raises(ConfigError, match="truncated") as err:
        train(compose_config([*LORA, f"ckpt_path={last}", "trainer.max_steps=6"], run_dir))
    assert str(last) in str(err.value)
    assert not (run_dir / "metrics.json").exists()

    # ckpt_path=auto skips it for the step-2 checkpoint beside it and trains on to the new length (6, not 4).
    metrics = train(compose_config([*LORA, "ckpt_path=auto", "trainer.max_steps=6"], run_dir))
    assert (metrics["status"], metrics["global_step"]) == ("ok", 6)
    assert metrics["tokens_this_run"] == 4 * STEP_TOKENS  # steps 3 to 6: it resumed at step 2
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 6
    assert saved[ADAPTER_KEY]["base_tensors_left_out"] > 0
    assert all(".lora_A." in k or ".lora_B." in k for k in saved["state_dict"])


@pytest.mark.parametrize(
    ("override", "key", "recorded"),
    [
        ("adapter.r=8", "adapter.r", "adapter.r=16"),
        ("adapter.alpha=8", "adapter.alpha", "adapter.alpha=32"),
        ("adapter=qlora", "adapter.kind", "resume with adapter=lora,"),
        ("adapter=none", "adapter", "resume with adapter=lora"),
        ("model.d_model=32", "model.d_model", "model.d_model=64"),
        ("model.n_layers=3", "model.n_layers", "model.n_layers=2"),
        ("seed=7", "seed", "seed=1234"),
    ],
)
def test_a_resume_that_builds_another_adapter_or_base_is_refused_before_building(
    crashed, tmp_path, override, key, recorded
):
    run_dir = _copy(crashed, tmp_path / "run")
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    with pytest.raises(ConfigError) as err:
        train(compose_config([*LORA, override, "ckpt_path=last", "trainer.max_steps=100"], run_dir))
    assert err.value.key == key
    assert recorded in err.value.fix  # the value that resumes
    assert "last.ckpt" in err.value.fix
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # nothing written


def test_a_plain_checkpoint_resumed_with_an_adapter_is_refused(teacher_run, tmp_path):
    run_dir = _copy(teacher_run, tmp_path / "run")
    with pytest.raises(ConfigError) as err:
        train(compose_config([*LORA, "ckpt_path=last", "trainer.max_steps=4"], run_dir))
    assert (err.value.key, err.value.value) == ("adapter", "lora")
    assert "resume it with adapter=none" in err.value.fix


def test_a_changed_pretrained_base_is_refused_by_path_before_building_and_by_hash_on_load(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    write_pretrained("llama", base, seed=0)
    write_pretrained("llama", other, seed=1)
    run_dir = tmp_path / "run"
    hf = ["model=hf", f"model.pretrained={base}", *TINY[4:], *CKPT, "adapter=lora", "trainer.max_steps=2"]
    assert train(compose_config(hf, run_dir))["status"] == "ok"
    resume = [*hf, "ckpt_path=last", "trainer.max_steps=4"]

    with pytest.raises(ConfigError) as err:  # another directory: the config says so
        train(compose_config([*resume, f"model.pretrained={other}"], run_dir))
    assert (err.value.key, err.value.value) == ("model.pretrained", str(other))
    assert f"model.pretrained={str(base)!r}" in err.value.fix

    # The same directory with other weights in it: only the base's SHA-256, checked as the checkpoint loads, sees it.
    shutil.rmtree(base)
    shutil.copytree(other, base)
    with pytest.raises(ConfigError) as err:
        train(compose_config(resume, run_dir))
    assert (err.value.key, err.value.value) == ("model.pretrained", str(base))
    assert "were replaced or retrained" in err.value.fix
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 2  # the first run's, kept


def test_a_full_disk_while_saving_keeps_the_previous_adapter_checkpoint(tmp_path):
    # Two adapter checkpoints (about 0.47 MB each) fit on 1.1 MB, the third does not: the save at step 4 fails.
    with small_tmpfs(tmp_path / "disk", "1100k") as disk:
        run_dir = tmp_path / "run"
        args = [*LORA, f"callbacks.model_checkpoint.dirpath={disk}"]
        with pytest.raises(CheckpointWriteError) as err:
            train(compose_config(args, run_dir))
        assert isinstance(err.value, TrainOptError)  # the CLI's one error line and exit code 2
        assert "No space left on device (ENOSPC" in str(err.value)
        assert str(err.value.path).startswith(str(disk))
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["status"] == "failed"
        assert str(err.value.path) in metrics["error"]
        assert not [n for n in os.listdir(disk) if n.startswith(".")]  # no partial file under any name
        assert checkpoint_problem(disk / "last.ckpt") is None
        saved = torch.load(disk / "last.ckpt", map_location="cpu", weights_only=False)
        assert saved["global_step"] == 2
        assert ADAPTER_KEY in saved

        resize_tmpfs(disk, "8m")  # space freed: the same command with ckpt_path=last finishes the run
        metrics = train(compose_config([*args, "ckpt_path=last"], run_dir))
        assert (metrics["status"], metrics["global_step"]) == ("ok", 4)


@pytest.mark.parametrize(("fmt", "size"), [("hf", "100k"), ("peft", "64k")])
def test_a_full_disk_while_exporting_leaves_nothing_at_out(crashed, tmp_path, capsys, fmt, size):
    with small_tmpfs(tmp_path / "disk", size) as disk:
        out = disk / "export"
        line = _export_refused([str(crashed), "--out", str(out), "--format", fmt], capsys)
        assert line.startswith(f"error: could not write --out={out}: No space left on device")
        assert os.listdir(disk) == []  # neither the output nor its hidden staging folder

        resize_tmpfs(disk, "8m")
        export_main([str(crashed), "--out", str(out), "--format", fmt])
        if fmt == "hf":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(out)
            assert model.config.hidden_size == 64
        else:
            assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]


def test_export_of_a_run_folder_without_an_adapter(teacher_run, tmp_path, capsys):
    line = _export_refused([str(teacher_run), "--out", str(tmp_path / "peft"), "--format", "peft"], capsys)
    assert str(teacher_run / "checkpoints") in line
    assert "holds no LoRA adapter" in line
    assert "--format state_dict or hf" in line
    assert not (tmp_path / "peft").exists()
    # The full fine-tune itself exports, as it is (no merge).
    export_main([str(teacher_run), "--out", str(tmp_path / "sd"), "--format", "state_dict"])
    state = torch.load(tmp_path / "sd" / "state_dict.pt")
    assert state
    assert not [k for k in state if "lora_" in k]

    line = _export_refused([str(tmp_path / "no_run"), "--out", str(tmp_path / "x")], capsys)
    assert "no_run" in line
    assert "does not exist" in line


def test_a_distill_run_resumed_with_another_or_changed_teacher_is_refused(teacher_run, tmp_path):
    teacher = tmp_path / "teacher.ckpt"
    shutil.copy(teacher_run / "checkpoints" / "last.ckpt", teacher)
    distill = ["experiment=distill", *TINY, *CKPT, "trainer.max_steps=2", "model.vocab_size=256"]
    run_dir = tmp_path / "student"
    metrics = train(compose_config([*distill, f"distill.teacher={teacher}"], run_dir))
    assert metrics["status"] == "ok"

    other = tmp_path / "other.ckpt"
    torch.save({**torch.load(teacher, weights_only=False), "extra": 1}, other)
    resume = [*distill, "ckpt_path=last", "trainer.max_steps=4"]
    with pytest.raises(ConfigError) as err:
        train(compose_config([*resume, f"distill.teacher={other}"], run_dir))
    assert (err.value.key, err.value.value) == ("distill.teacher", str(other))
    assert str(teacher) in err.value.fix

    shutil.copy(other, teacher)  # the same path, its file retrained since
    with pytest.raises(ConfigError) as err:
        train(compose_config([*resume, f"distill.teacher={teacher}"], run_dir))
    assert (err.value.key, err.value.value) == ("distill.teacher", str(teacher))
    assert "its files changed since" in err.value.fix
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 2  # the first run's, kept
