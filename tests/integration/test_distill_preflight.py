"""``experiment=distill`` under tensor parallelism: a teacher the student's TP plan cannot split (heads, KV heads,
FFN width, vocabulary) or whose architecture has no plan is refused in the launching process, before a rank is
spawned, by ``train()``, the CLI (exit 2) and ``plan.py``, with the error the TP step of the set-up raises
(``parallel/tp.py`` ``check_teacher_tensor_parallel``: one rule, three callers)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_trainopt.config.plan import plan
from lightning_trainopt.exceptions import IncompatibleConfigError
from lightning_trainopt.launch.train import train
from lightning_trainopt.models import GPT, GPTConfig
from tests.helpers.compose import REPO_ROOT, TINY, compose_config
from tests.helpers.env import child_env
from tests.helpers.hf_files import write_pretrained

TP = ["experiment=distill", "+strategy=tp", "trainer=ddp_sim", *TINY]
#: Our GPT teacher whose FFN width (97) TP 2 does not divide; everything else splits.
ODD_FFN = GPTConfig(n_layers=1, d_model=48, n_heads=2, ffn_hidden=97, max_seq_len=64)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Teachers TP 2 cannot split: a HF Llama with 3 heads, a HF GPT-2 (no plan), our .ckpt with an odd FFN width;
    and a HF Llama it can split (4 heads, 2 KV heads)."""
    root = tmp_path_factory.mktemp("teachers")
    write_pretrained("llama", root / "llama_3_heads", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    write_pretrained("gpt2", root / "gpt2")
    write_pretrained("llama", root / "llama")
    torch.manual_seed(0)
    # A Lightning checkpoint as LitGPT writes it: the weights under model., the shape in the hyper-parameters.
    state = {f"model.{k}": v for k, v in GPT(ODD_FFN).state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"model": asdict(ODD_FFN)}}, root / "odd_ffn.ckpt")
    return {p.stem: p for p in root.iterdir()}


WHAT = {"llama_3_heads": "attention heads 3, key/value heads 3", "gpt2": "has no tensor-parallel plan",
        "odd_ffn": "FFN width 97"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(WHAT))
def test_train_refuses_a_teacher_tp_cannot_split_before_anything_is_built(teachers, tmp_path, monkeypatch, name):
    def no_fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fit started: it spawns the ranks")

    monkeypatch.setattr(pl.Trainer, "fit", no_fit)
    run_dir = tmp_path / "run"
    with pytest.raises(IncompatibleConfigError) as err:
        train(compose_config([*TP, f"distill.teacher={teachers[name]}"], run_dir))
    assert err.value.keys == {"distill.teacher": str(teachers[name]), "strategy.tensor_parallel_size": 2}
    assert WHAT[name] in err.value.reason
    assert not (run_dir / "metrics.json").exists()
    assert not (run_dir / "checkpoints").exists()


def test_the_cli_exits_2_with_one_line_and_spawns_nothing(teachers, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", *TP, f"distill.teacher={teachers['llama_3_heads']}", f"hydra.run.dir={run_dir}"],
        cwd=REPO_ROOT, env=child_env(REPO_ROOT), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: distill.teacher='{teachers['llama_3_heads']}' + strategy.tensor_parallel_size=2 is refused: the "
        "distillation teacher is split by the student's tensor-parallel plan, and its architecture (llama) has sizes "
        "not divisible by 2: attention heads 3, key/value heads 3. Fix: use a teacher whose heads, KV heads, FFN "
        "width and vocabulary the TP size divides (and an architecture with a plan: gpt, llama, mistral, qwen2), a "
        "smaller strategy.tensor_parallel_size, or +strategy=fsdp."
    ]
    # What any refusal leaves: Hydra's record of the config and the log; no rank ran (each logs Lightning's
    # "Initializing distributed: GLOBAL_RANK: R" into this log; none wrote metrics.json or checkpoints).
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "distill.log"]
    log = (run_dir / "distill.log").read_text()
    assert "Initializing distributed" not in log
    assert "is refused: the distillation teacher" in log


def test_plan_py_refuses_what_train_py_refuses(teachers, tmp_path):
    planned = ["experiment=distill", "+strategy=tp", "trainer.devices=2", "hardware=cpu"]
    for name in ("llama_3_heads", "gpt2"):  # plan.py reads a HF teacher's config.json (not our .ckpt files)
        with pytest.raises(IncompatibleConfigError) as err:
            plan(compose_config([*planned, f"distill.teacher={teachers[name]}"], tmp_path, "plan"))
        assert err.value.keys == {"distill.teacher": str(teachers[name]), "strategy.tensor_parallel_size": 2}
        assert WHAT[name] in err.value.reason
    # distill.teacher_model (a GPTConfig node) is read too.
    node = [f"+distill.teacher_model.{k}={v}" for k, v in asdict(ODD_FFN).items() if v is not None]
    gpt = [*planned, f"distill.teacher={teachers['odd_ffn']}", "+distill.teacher_model._target_=x.GPTConfig", *node]
    with pytest.raises(IncompatibleConfigError, match="FFN width 97"):
        plan(compose_config(gpt, tmp_path, "plan"))
    # Teachers it can split, or no TP: planned.
    ok = plan(compose_config([*planned, f"distill.teacher={teachers['llama']}"], tmp_path, "plan"))
    assert ok.estimate.inputs.teacher is not None
    fsdp = ["experiment=distill", "+strategy=fsdp", "trainer.devices=2", "hardware=cpu"]
    unsplit = plan(compose_config([*fsdp, f"distill.teacher={teachers['gpt2']}"], tmp_path, "plan"))
    assert unsplit.estimate.inputs.teacher is not None
