"""FSDP2 and TP checkpoints are DCP directories: written by every rank, resumed on another layout, converted.

One 2-process fit writes a checkpoint (each rank its own ``__<rank>_0.distcp``); a 1-process run loads it (DCP
reshards on load) and saves it again; a 2-process run loads that one and saves it again. A 2-process tensor-parallel
fit (TP 2) is loaded on 1 process (TP 1) the same way. Loading and saving copy tensors, so every weight and every
AdamW moment must come back bit for bit, whatever the number of ranks or the TP size.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_trainopt.checkpoint.convert import convert_checkpoint, main
from lightning_trainopt.checkpoint.dcp import is_dcp_checkpoint, read_dcp_tensors
from lightning_trainopt.checkpoint.verify import checkpoint_problem
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models import GPT, GPTConfig
from tests.helpers.compose import REPO_ROOT
from tests.helpers.env import child_env

WORKER = Path(__file__).with_name("_reshard_worker.py")
STEPS = 3
SHAPE = GPTConfig(n_layers=2, d_model=64, n_heads=4, ffn_hidden=128, max_seq_len=16)


def _worker(devices: int, save: Path, load: Path | None = None, tp: bool = False) -> None:
    args = [sys.executable, str(WORKER), str(devices), str(STEPS), str(save), *([str(load)] if load else [])]
    args += ["tp"] if tp else []
    proc = subprocess.run(args, cwd=REPO_ROOT, env=child_env(REPO_ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(devices):
        assert f"rank {rank}: saved step {STEPS}" in proc.stdout, proc.stdout[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``two``: trained on 2 ranks; ``one``: it loaded on 1 rank and saved; ``back``: that loaded on 2 and saved;
    ``tp``: trained with TP 2; ``tp_one``: it loaded on 1 rank and saved."""
    tmp = tmp_path_factory.mktemp("dcp")
    paths = {name: tmp / f"{name}.ckpt" for name in ("two", "one", "back", "tp", "tp_one")}
    _worker(2, paths["two"])
    _worker(1, paths["one"], load=paths["two"])
    _worker(2, paths["back"], load=paths["one"])
    _worker(2, paths["tp"], tp=True)
    _worker(1, paths["tp_one"], load=paths["tp"])
    return paths


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_dcp_tensors(path, prefix="")


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_each_rank_writes_its_own_part_and_the_directory_is_sealed(saved):
    for name, ranks in (("two", 2), ("one", 1), ("back", 2), ("tp", 2), ("tp_one", 1)):
        path = saved[name]
        assert is_dcp_checkpoint(path)
        assert checkpoint_problem(path) is None  # our manifest, written after every rank's part
        assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(ranks)]


@pytest.mark.slow
def test_two_ranks_to_one_and_back_keep_every_weight_and_optimizer_moment(saved):
    two = _all_tensors(saved["two"])
    optimizer = [k for k in two if k.startswith("optimizer_0.state.")]
    assert any(k.endswith(".exp_avg_sq") for k in optimizer)
    assert two["optimizer_0.state.model.embed.weight.step"].item() == STEPS  # trained, not a fresh model
    _assert_same(two, _all_tensors(saved["one"]))  # 2 -> 1 rank
    _assert_same(two, _all_tensors(saved["back"]))  # 1 -> 2 ranks


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_on_another_tp_size(saved):
    tp = _all_tensors(saved["tp"])
    assert tp["optimizer_0.state.model.embed.weight.step"].item() == STEPS
    _assert_same(tp, _all_tensors(saved["tp_one"]))  # TP 2 -> 1


@pytest.mark.slow
def test_convert_gives_the_plain_state_dict_and_a_hugging_face_directory_with_the_same_logits(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    main([str(saved["two"]), str(tmp_path / "gpt.pt"), "--hf-dir", str(tmp_path / "hf")])
    state = torch.load(tmp_path / "gpt.pt", weights_only=True)
    weights = read_dcp_tensors(saved["two"])
    assert state.keys() == {k.removeprefix("model.") for k in weights}
    gpt = GPT(SHAPE).eval()
    gpt.load_state_dict(state, strict=True)
    for key, tensor in weights.items():
        torch.testing.assert_close(gpt.state_dict()[key.removeprefix("model.")], tensor, rtol=0, atol=0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, SHAPE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = gpt(idx), hf(idx).logits
    # Same fp32 arithmetic in another order (rotary halves instead of pairs): agreement to rounding.
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_convert_refuses_a_directory_that_is_no_sharded_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="FSDP2/TP checkpoint directory"):
        convert_checkpoint(tmp_path, tmp_path / "out.pt")


@pytest.mark.slow
def test_a_hugging_face_model_trained_under_fsdp2_converts_to_its_own_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_trainopt.checkpoint.hf_export import llama_config

    llama_config(SHAPE).save_pretrained(tmp_path / "config")
    run = tmp_path / "run"
    args = [
        "model=hf",
        f"model.config={tmp_path / 'config'}",
        "data.seq_len=16",
        "data.batch_size=2",
        "data.max_bytes=2400",
        "trainer=ddp_sim",
        "+strategy=fsdp",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "logger=none",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=REPO_ROOT,
        env=child_env(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    assert is_dcp_checkpoint(ckpt)
    convert_checkpoint(ckpt, None, hf_dir=tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    saved = read_dcp_tensors(ckpt)  # the LightningModule's keys: model.<the Hugging Face model's own keys>
    assert {k.removeprefix("model.") for k in saved} == set(hf.state_dict())
    for key, tensor in saved.items():
        torch.testing.assert_close(hf.state_dict()[key.removeprefix("model.")], tensor, rtol=0, atol=0)
