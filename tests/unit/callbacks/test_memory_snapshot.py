import json
import os
import pickle

import pytest
import torch

from lightning_trainopt.callbacks import MemoryBreakdown, MemorySnapshot
from lightning_trainopt.exceptions import ConfigError
from lightning_trainopt.models.lit_gpt import LitGPT
from tests.helpers.runif import RunIf
from tests.helpers.tiny_fit import TINY, tiny_data, tiny_module, tiny_trainer


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_switches_off_on_cpu(tmp_path):
    cb = MemorySnapshot(dirpath=str(tmp_path))
    with pytest.warns(UserWarning, match="MemorySnapshot is off"):
        tiny_trainer([cb], max_steps=2).fit(tiny_module(), tiny_data())
    assert cb.summary()["memory_snapshot"] == {"enabled": False, "files": [], "oom": None}
    assert os.listdir(tmp_path) == []


def test_bad_arguments():
    with pytest.raises(ConfigError, match="num_steps"):
        MemorySnapshot(num_steps=0)


@RunIf(min_cuda_gpus=1)
def test_window_snapshot_on_gpu(tmp_path):
    cb = MemorySnapshot(dirpath=str(tmp_path), start_step=1, num_steps=2, on_oom=False)
    tiny_trainer([cb], max_steps=4, accelerator="gpu").fit(tiny_module(), tiny_data())
    assert cb.files == [str(tmp_path / "snapshot_rank0_steps1-2.pickle")]
    with open(cb.files[0], "rb") as fh:
        snap = pickle.load(fh)
    assert snap["segments"]
    assert snap["device_traces"]


class OOMAt(LitGPT):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            free, _ = torch.cuda.mem_get_info()
            torch.empty(int(free * 4), dtype=torch.uint8, device=self.device)
        return super().training_step(batch, batch_idx)


@RunIf(min_cuda_gpus=1)
def test_oom_writes_snapshot_breakdown_and_advice(tmp_path):
    cb = MemorySnapshot(dirpath=str(tmp_path), start_step=None, on_oom=True)
    trainer = tiny_trainer([MemoryBreakdown(at_steps=[1]), cb], max_steps=5, accelerator="gpu")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        trainer.fit(OOMAt(TINY), tiny_data())
    assert os.path.getsize(tmp_path / "oom_rank0.pickle") > 0
    report = json.loads((tmp_path / "oom_rank0.json").read_text())
    assert report["activations_source"] == "MemoryBreakdown"
    assert report["breakdown"]["activations"] > 0
    assert report["breakdown"]["params"] == TINY.n_params() * 4
    assert any("activations are" in line for line in report["advice"])


@pytest.mark.parametrize(("max_steps", "name"), [(3, "steps1-2"), (10, "steps1-3"), (2, "steps1-1")])
def test_a_run_that_ends_inside_the_window_still_writes_it(tmp_path, monkeypatch, max_steps, name):
    # The allocator calls are CUDA-only: record what the hooks ask for (the GPU test above runs the real ones).
    from types import SimpleNamespace

    from lightning_trainopt._compat import torch_internals as private

    dumped = []
    monkeypatch.setattr(private, "start_memory_history", lambda max_entries: None)
    monkeypatch.setattr(private, "stop_memory_history", lambda: None)
    monkeypatch.setattr(private, "dump_memory_snapshot", dumped.append)
    cb = MemorySnapshot(dirpath=str(tmp_path), start_step=1, num_steps=3, on_oom=False)
    trainer = SimpleNamespace(global_step=0, max_steps=max_steps, global_rank=0)
    cb.on_train_start(trainer, None)
    for step in range(max_steps):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, None, None, step)
        trainer.global_step = step + 1
        cb.on_train_batch_end(trainer, None, None, None, step)
    assert dumped == [str(tmp_path / f"snapshot_rank0_{name}.pickle")]
    assert cb.files == dumped
