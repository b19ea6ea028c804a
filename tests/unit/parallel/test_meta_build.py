"""FSDP2 builds our GPT, a Hugging Face model (from its config or ``model.pretrained``) and a user's module on the
meta device; each rank initialises, or reads from the saved files, only its shards. One 2-rank spawn checks them all
(``_meta_build_worker.py``)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from lightning_trainopt.exceptions import ConfigError  # noqa: E402
from lightning_trainopt.parallel import TrainOptFSDPStrategy  # noqa: E402
from lightning_trainopt.parallel.meta_init import load_sharded, materialize_sharded  # noqa: E402
from tests.helpers.hf_files import _config, write_config  # noqa: E402
from tests.unit.parallel import _meta_build_worker as w  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tiny(kind: str = "llama", **overrides):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(_config(kind, w.VOCAB, **overrides))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("meta_build")
    write_config("llama", workdir / "config", vocab_size=w.VOCAB, tie_word_embeddings=True)
    torch.manual_seed(7)
    # Several safetensors files with an index, as save_pretrained writes a large model.
    _tiny(tie_word_embeddings=True).save_pretrained(workdir / "weights", max_shard_size="20KB")
    results = mp.Manager().dict()
    mp.spawn(w.worker, args=(_port(), str(workdir), results), nprocs=2, join=True)
    return dict(results)


def test_our_gpt_each_rank_holds_its_shard_of_the_same_weights_as_a_whole_build(two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank]["gpt"]
        assert got["equal"] == got["names"]  # every parameter, bit for bit
        assert got["n"] == len(got["names"])
        assert got["tied"]
        assert got["rng_as_after_eager"]  # later draws (dropout, data order) match a whole build's too
    assert (two_ranks[0]["gpt"]["local_rows"], two_ranks[1]["gpt"]["local_rows"]) == (34, 33)


def test_a_hugging_face_model_from_its_config_gets_a_whole_build_s_weights_shard_by_shard(two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank]["hf"]
        assert got["built_on_meta"] == (True, False)  # no rank ever held the whole model; the baseline did
        assert got["n_weights"] > 0
        assert got["differ"] == []  # every parameter, bit for bit (transformers' init replayed per shard)
        assert got["tied"]
        assert got["inv_freq"]  # the rotary buffer, filled by the model's own init
        assert got["local_share"] < 0.6  # this rank's shards: about half of the model
        meta_losses, whole_losses = got["losses"]
        assert len(meta_losses) == w.STEPS
        assert meta_losses == pytest.approx(whole_losses, rel=1e-6, abs=1e-6)


def test_pretrained_weights_are_read_slice_by_slice_and_equal_from_pretrained_s(two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank]["pretrained"]
        assert got["files"] > 1
        assert got["built_on_meta"]
        assert got["differ"] == []
        assert got["logits_max_diff"] < 1e-5
        # Each rank reads its half of every tensor (the tied head is read once, as the embedding).
        assert 0.4 < got["read_share"] < 0.6


def test_a_user_module_built_in_configure_model_is_initialised_per_shard_by_reset_parameters(two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank]["user"]
        assert got["built_on_meta"]
        assert got["n_weights"] == 5
        assert got["differ"] == []
        assert len(got["losses"]) == w.STEPS


def test_what_builds_on_meta(tmp_path):
    from lightning_trainopt.models import HFModelConfig, LitCausalLM

    strategy = TrainOptFSDPStrategy()

    class BuiltInInit(w.UserModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

    assert strategy.builds_on_meta(w.UserModule())
    assert not strategy.builds_on_meta(BuiltInInit())  # its model exists before configure_model
    assert not TrainOptFSDPStrategy(meta_init=False).builds_on_meta(w.UserModule())
    write_config("llama", tmp_path, vocab_size=w.VOCAB)
    assert strategy.builds_on_meta(LitCausalLM(HFModelConfig(config=str(tmp_path))))


def test_a_module_with_parameters_nothing_initialises_is_refused_naming_it_and_the_fix():
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        root = torch.nn.Sequential(torch.nn.Linear(3, 3), Scale())
    with pytest.raises(ConfigError, match=r"Scale.*strategy.meta_init=false") as err:
        materialize_sharded(root, torch.device("cpu"))
    assert err.value.key == "strategy.meta_init"


def test_parameters_with_values_beside_meta_ones_are_refused_not_overwritten():
    # A user's configure_model that loads part of its weights with load_state_dict(assign=True) on the meta device.
    with torch.device("meta"):
        root = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
    root[0][1].load_state_dict({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, assign=True)
    with pytest.raises(ConfigError, match=r"0\.1\.weight \(Linear\).*strategy.meta_init=false"):
        materialize_sharded(root, torch.device("cpu"))
    assert torch.equal(root[0][1].weight, torch.ones(2, 2))


def test_a_meta_buffer_nothing_fills_is_refused():
    class WithTable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.register_buffer("table", torch.arange(4.0))

    with torch.device("meta"):
        root = torch.nn.Sequential(WithTable())
    with pytest.raises(ConfigError, match=r"buffers.*table \(WithTable\).*strategy.meta_init=false"):
        materialize_sharded(root, torch.device("cpu"))


def test_hf_llama_replayed_on_an_unsharded_meta_model_equals_from_config():
    torch.manual_seed(3)
    eager = _tiny(tie_word_embeddings=True)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with torch.device("meta"):
        holder = torch.nn.ModuleDict({"model": _tiny(tie_word_embeddings=True)})
    materialize_sharded(holder, torch.device("cpu"), state)
    got = holder["model"].state_dict()
    assert [name for name, t in eager.state_dict().items() if not torch.equal(t, got[name])] == []


def test_hf_gpt2_gets_its_init_s_distributions():
    # GPT-2's Conv1D draws its weight in __init__ without a reset_parameters, which a replay cannot repeat, so the
    # meta build's draws are not the eager build's; each tensor still comes from the init GPT-2 defines.
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with torch.device("meta"):
        holder = torch.nn.ModuleDict({"model": _tiny("gpt2", n_embd=64)})
    materialize_sharded(holder, torch.device("cpu"), state)
    model = holder["model"]
    std, layers = model.config.initializer_range, model.config.n_layer
    block = model.transformer.h[0]
    assert model.transformer.wte.weight.std().item() == pytest.approx(std, rel=0.1)
    assert block.attn.c_attn.weight.std().item() == pytest.approx(std, rel=0.1)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(std / (2 * layers) ** 0.5, rel=0.1)
    assert torch.equal(block.attn.c_attn.bias, torch.zeros_like(block.attn.c_attn.bias))
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))


def test_saved_weights_that_do_not_match_the_model_are_refused_naming_the_keys(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    saved = {name: t.contiguous() for name, t in _tiny().state_dict().items()}
    saved["model.extra.weight"] = torch.zeros(2)
    del saved["model.norm.weight"]
    save_file(saved, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = _tiny()
    model.to_empty(device="cpu")
    files = dict.fromkeys(saved, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing 1 \['model.norm.weight'\], unexpected 1 \['model.extra.weight'\]"):
        load_sharded(model, files)
