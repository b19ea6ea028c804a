"""Lightning's own state is read from each strategy's checkpoint layout, ZeRO-3's per-rank model-states file too."""

import pytest
import torch

from lightning_trainopt.checkpoint.state import lightning_state, saved_loader_states

STATE = {"global_step": 2, "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"samples_consumed": 16}]}}}}


@pytest.mark.parametrize(
    "layout",
    [
        "checkpoint/mp_rank_00_model_states.pt",  # DeepSpeed ZeRO-1/2
        "checkpoint/zero_pp_rank_0_mp_rank_00_model_states.pt",  # ZeRO-3: one file per data-parallel rank
        "meta.pt",  # ModelParallelStrategy (FSDP2)
    ],
)
def test_each_layout(tmp_path, layout):
    path = tmp_path / "last.ckpt" / layout
    path.parent.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}, **STATE}, path)
    assert lightning_state(tmp_path / "last.ckpt")["global_step"] == 2
    assert saved_loader_states(tmp_path / "last.ckpt") == [{"samples_consumed": 16}]


def test_a_folder_without_state_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint this app wrote"):
        lightning_state(tmp_path)
