"""Tensor and sequence parallelism: the plans, their refusals, and a real 4-process gloo run (2 x 2 mesh).

The 4-process run (``_tp_worker.py``, one process group for all of it) trains our GPT and a tiny Hugging Face Llama
with TP 2 x FSDP2 2 against a whole model on the same global batch (what DDP computes), builds both on the meta device
(and a pretrained Llama slice by slice) under TP 2 x FSDP2 2 against whole builds, and fits a LitGPT with
``TrainOptTPStrategy`` on the HSDP mesh (2 replicas x 1 shard x TP 2), and walks the OK cells of the ``tp`` and
``fsdp_tp`` columns of the technique x strategy table, and distils a GPT student from a GPT teacher under TP 2 x
FSDP2 2. TP alone on 2 processes through the app (``+strategy=tp``) is tests/integration/test_tensor_parallel_app.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_trainopt.config.parallel_dims import parallel_dims_of
from lightning_trainopt.exceptions import ConfigError, IncompatibleConfigError
from lightning_trainopt.models.config import GPTConfig
from lightning_trainopt.models.gpt import GPT
from lightning_trainopt.parallel.apply import RewritePlan, apply_rewrites
from lightning_trainopt.parallel.tp import (
    ARCHITECTURES,
    apply_tensor_parallel,
    architecture_of,
    clip_grad_norm_,
    tp_divisibility_errors,
)
from lightning_trainopt.parallel.tp_strategy import TrainOptTPStrategy
from tests.helpers.compose import compose_config
from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[3]
TINY = GPTConfig(name="t", vocab_size=64, n_layers=1, d_model=32, n_heads=4, ffn_hidden=64, max_seq_len=16)


class _Mesh:
    """Stands in for a 1-D device mesh where only its size is read before anything is split."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    worker = ROOT / "tests" / "unit" / "parallel" / "_tp_worker.py"
    done = subprocess.run([*cmd, str(worker), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_loss_and_clipped_norm_match_a_whole_model_on_the_same_data(ranks, kind):
    for seen in ranks:
        got = seen["raw"][kind]
        assert len(got["losses"]) == 4
        # fp32: within 1e-4 relative after every step (the updates use the clipped gradients of the steps before).
        assert got["losses"] == pytest.approx(got["whole_losses"], rel=1e-4)
        # Clipping over DTensor (TP x FSDP2) and plain parameters: the same total norm as torch's on the whole model.
        assert got["norms"] == pytest.approx(got["whole_norms"], rel=1e-4)
        assert min(got["whole_norms"]) > 0.5  # so clipping to 0.5 really scaled every step


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_each_rank_holds_one_tp_th_of_the_parameters_norm_vectors_excepted(ranks, kind):
    got = ranks[0]["raw"][kind]
    split = got["whole_elements"] - got["norm_elements"]
    assert got["local_elements_tp"] == split // 2 + got["norm_elements"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_a_meta_build_split_by_tp_and_fsdp_equals_a_whole_build_bit_for_bit(ranks, kind):
    for seen in ranks:
        got = seen["meta"][kind]
        assert got["names"] == got["n"] == 20  # every parameter materialised (the tied head once)
        assert got["differ"] == []  # torch.equal against the whole build from the same seed, weight by weight
        assert got["tied"]
        # TP 2 x FSDP2 2: a quarter of the elements, plus the norm vectors TP replicates (a bit over 0.25).
        assert 0.25 <= got["local_share"] < 0.27


@pytest.mark.slow
def test_a_pretrained_llama_is_read_slice_by_slice_under_tp_and_fsdp(ranks):
    for seen in ranks:
        got = seen["meta"]["pretrained"]
        assert got["names"] == 20
        assert got["differ"] == []  # every weight as from_pretrained's
        assert got["tied"]
        assert got["logits_max_diff"] < 1e-5  # TP sums partial products in another order
        # Each rank read only its pieces of the safetensors tensors: about a quarter, never the whole model.
        assert 0.25 <= got["read_share"] < 0.27


@pytest.mark.slow
def test_fit_on_the_hsdp_mesh_reads_one_batch_per_replica_and_clips(ranks):
    fits = [seen["fit"] for seen in ranks]
    for rank, fit in enumerate(fits):
        assert fit["mesh"] == ["dp_replicate", "dp_shard", "tp"]
        assert fit["dims"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 2}
        assert fit["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert fit["dtensors"] == fit["params"]
        assert fit["builds_on_meta"]  # the fit's model was built on meta and materialised piece by piece
        assert all(n > 0.5 for n in fit["grad_norms"])
        assert fit["clipped_norms"] == pytest.approx([0.5] * 3, rel=1e-4)  # Lightning's gradient_clip_val=0.5
    assert fits[0]["batches"] == fits[1]["batches"]
    assert fits[2]["batches"] == fits[3]["batches"]
    assert fits[0]["batches"] != fits[2]["batches"]
    assert fits[0]["losses"] == fits[1]["losses"]
    assert fits[0]["losses"] != fits[2]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_lora_under_tp_and_fsdp2_trains_like_one_process(ranks, mesh):
    """adapter=lora under +strategy=fsdp_tp (TP 2 x FSDP2 2, and TP 2 x HSDP 2 replicas): the ADAPTER_TABLE cell
    it allows."""
    for seen in ranks:
        got = seen["lora"][mesh]
        assert got["losses"] == pytest.approx(got["whole_losses"], abs=1e-5)
        assert got["adapter_names_match"]
        assert got["adapter_max_diff"] < 1e-5  # the adapters trained to the one-process replay's values
        assert got["lora_b_norm"] > 0  # they did train (peft starts lora_B at zero)
        assert got["base_unchanged"]
        assert got["frozen_numel"] > 2 * got["trainable_numel"]
        # optimizer state for exactly the adapters, each a DTensor (TP's layouts, sharded by FSDP2)
        assert got["state_numel"] == got["trainable_numel"]
        assert got["state_params"] == got["dtensors"] == 28  # q, k, v, o, gate, up, down x A, B x 2 blocks


def test_an_architecture_without_a_plan_is_refused_with_those_that_have_one():
    with pytest.raises(IncompatibleConfigError) as err:
        apply_tensor_parallel(torch.nn.Sequential(torch.nn.Linear(4, 4)), _Mesh(2))
    assert all(name in str(err.value) for name in ARCHITECTURES)
    assert "Sequential" in str(err.value)


def test_sizes_the_tp_size_does_not_divide_are_named():
    with pytest.raises(IncompatibleConfigError, match=r"attention heads 4, key/value heads 4, FFN width 64"):
        apply_tensor_parallel(GPT(TINY), _Mesh(3))
    assert tp_divisibility_errors({"heads": 8, "kv_heads": 2, "ffn": 64, "vocab": 50}, 4, seq_len=30) == [
        "key/value heads 2",
        "vocabulary 50",
        "sequence length 30 (sequence parallelism splits it)",
    ]
    assert tp_divisibility_errors({"heads": 8, "kv_heads": 4, "ffn": 64, "vocab": 64}, 4, seq_len=32) == []


def test_architecture_of_gpt_and_hf_llama_family():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    small["num_attention_heads"] = 2
    assert architecture_of(GPT(TINY)) == "gpt"
    assert architecture_of(LlamaForCausalLM(LlamaConfig(**small))) == "llama"
    assert architecture_of(Qwen2ForCausalLM(Qwen2Config(**small))) == "qwen2"


def test_the_rewrite_refuses_tp_without_its_mesh():
    with pytest.raises(ConfigError, match="strategy.tensor_parallel_size"):
        apply_rewrites(GPT(TINY), RewritePlan(tensor_parallel=2))


def test_clip_grad_norm_of_plain_parameters_matches_torch():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 3)).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    got = clip_grad_norm_(b.parameters(), 0.1)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"tensor_parallel_size": 0}, "strategy.tensor_parallel_size"),
        ({"replicate": 0}, "strategy.replicate"),
        ({"data_parallel_size": 2}, "strategy.data_parallel_size"),
    ],
)
def test_the_strategy_refuses_bad_sizes_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        TrainOptTPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("preset", "overrides", "dims"),
    [
        ("tp", [], {"dp_replicate": 1, "dp_shard": 1, "tp": 4}),
        ("fsdp_tp", ["strategy.tensor_parallel_size=2"], {"dp_replicate": 1, "dp_shard": 2, "tp": 2}),
        (
            "fsdp_tp",
            ["strategy.tensor_parallel_size=2", "strategy.replicate=2"],
            {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
        ),
    ],
)
def test_presets_give_the_dims(preset, overrides, dims):
    cfg = compose_config([f"+strategy={preset}", "trainer.devices=4", *overrides])
    assert parallel_dims_of(4, 1, cfg.strategy).to_dict() == dims


def test_replicas_that_do_not_divide_the_world_are_refused_naming_the_key():
    with pytest.raises(IncompatibleConfigError, match="strategy.replicate"):
        parallel_dims_of(4, 1, {"tensor_parallel_size": 2, "replicate": 3})


@pytest.mark.slow
def test_every_ok_tp_and_fsdp_tp_cell_composes_and_matches_a_whole_model(ranks):
    from lightning_trainopt.parallel.compat_table import TABLE, TECHNIQUES

    cells = {f"{t}+{f}" for f in ("tp", "fsdp_tp") for t in TECHNIQUES if TABLE[t][f] is None and t != "chunked_ce"}
    techniques = ("fp8", "keep_fp32", "checkpoint", "offload", "int8", "compile")
    assert cells == {f"{t}+{f}" for t in techniques for f in ("tp", "fsdp_tp")}
    for seen in ranks:
        walked = {k: v for k, v in seen["walk"].items() if "+" in k}
        assert set(walked) == cells
        for cell, got in walked.items():
            assert "error" not in got, (cell, got)
            assert got["grads"], cell
            assert "tensor_parallel" in got["steps"]
            # keep_fp32 and fp8 run under bf16 autocast (the whole model too): a looser bound there.
            bf16 = cell.startswith(("keep_fp32", "fp8"))
            assert got["loss"] == pytest.approx(got["want"], rel=1e-3 if bf16 else 1e-4), cell
            if not bf16 and not cell.startswith("int8"):
                assert got["grad_error"] < 1e-4, cell
            # Then without grad, as validation runs (a compiled TP block once failed there): the same loss.
            assert got["no_grad_loss"] == pytest.approx(got["loss"], rel=1e-5), cell


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tp", "fsdp_tp"])
def test_fp8_under_tp_runs_torchaos_float8_matmuls_on_the_shards_and_matches_the_fp8_model(ranks, family):
    """FP8 without sequence parallelism: torchao's float8 plans on gloo, against the same FP8 model on one process."""
    for seen in ranks:
        got = seen["walk"][f"fp8+{family}"]
        # Under FSDP2 (fsdp_tp) as the app converts: FSDP2 all-gathers the float8 weights over the data-parallel ranks.
        assert got["fsdp_float8_all_gather"] == (family == "fsdp_tp")
        assert got["float8_layers"] == 2 * 7  # q, k, v, o, gate, up, down of both blocks (the head stays bf16)
        shapes = {tuple(s) for s in got["float8_mm_weights"]}
        # torchao's float8 matmul ran on each rank's half of each weight, as (in, out) after its transpose: q (32 of
        # 32 -> 16 of 32 outputs), k/v (8 of 16), o (16 of 32 inputs), gate/up (32 of 64 outputs), down (32 of 64
        # inputs); never on a whole gate/up (32, 64) or down (64, 32).
        assert {(32, 16), (32, 8), (16, 32), (32, 32)} <= shapes
        assert not shapes & {(32, 64), (64, 32)}
        # Within bf16 rounding of the whole FP8 model (its tensorwise scales are reduced over the shards: the same).
        assert got["loss"] == pytest.approx(got["want"], rel=1e-3)
        assert got["grad_error"] < 0.03  # measured 0.018 (bf16 partial sums added in another order)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_tp_without_sequence_parallelism_matches_a_whole_model(ranks, kind):
    for seen in ranks:
        got = seen["walk"][f"no_sequence_parallel_{kind}"]
        assert not got["sequence_parallel"]
        assert got["norms_plain"]  # the norms are replicated plain parameters, not sequence-parallel
        assert got["loss"] == pytest.approx(got["want"], rel=1e-5)
        assert got["grad_error"] < 1e-5


@pytest.mark.slow
def test_fp8_with_sequence_parallelism_is_refused_on_gloo_naming_the_key(ranks):
    for seen in ranks:
        message = seen["walk"]["fp8_sequence_parallel"]
        assert "strategy.sequence_parallel" in message
        assert "gloo" in message
        assert "NCCL" in message


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tp", "fsdp_tp"])
def test_int8_under_tp_compresses_each_local_shard_within_the_one_device_bound(ranks, family):
    for seen in ranks:
        got = seen["walk"][f"int8+{family}"]
        assert got["n_compressed"] > 10  # the DTensor activations' local shards, not passed through
        assert got["saved_by_dtype"].get("int8", 0) > 0  # what the graph keeps is int8 codes (+ fp32 scales)
        assert got["loss"] == pytest.approx(got["want"], rel=1e-5)  # compression changes backward only
        # The bound of tests/unit/transforms/test_compression.py on one device.
        assert 0 < got["grad_error"] < 0.03


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.devices=2", "strategy.tensor_parallel_size=4", "trainer.num_nodes=2"], "larger than a node's 2"),
        (["trainer.devices=4", "strategy.tensor_parallel_size=4", "model.n_heads=2"], "attention heads 2"),
        (["trainer.devices=4", "strategy.tensor_parallel_size=4", "data.seq_len=30"], "sequence length 30"),
        (["trainer.devices=4", "strategy.tensor_parallel_size=4", "model.ffn_hidden=350"], "FFN width 350"),
    ],
)
def test_preflight_refuses_what_tp_cannot_split_naming_the_key(overrides, message):
    from lightning_trainopt.config.preflight import preflight_from_cfg

    cfg = compose_config(
        ["+strategy=fsdp_tp", "model=gpt_tiny", "data=synthetic", "trainer.accelerator=cpu", *overrides]
    )
    with pytest.raises(IncompatibleConfigError, match="strategy.tensor_parallel_size") as err:
        preflight_from_cfg(cfg)
    assert message in str(err.value)


def test_preflight_passes_a_tp_config_that_splits_with_either_loss():
    from lightning_trainopt.config.preflight import preflight_from_cfg

    base = ["+strategy=tp", "model=gpt_tiny", "data=synthetic", "trainer=ddp_sim"]
    preflight_from_cfg(compose_config(base))
    preflight_from_cfg(compose_config([*base, "loss=chunked_ce"]))


def test_a_rank_reads_its_rows_and_columns_of_a_saved_tensor(tmp_path):
    """A TP x FSDP2 piece cuts two dimensions: the safetensors slice and the .bin narrow give that box alone."""
    from safetensors.torch import save_file

    from lightning_trainopt.parallel.meta_init import _MappedBin, _read_piece

    whole = torch.arange(48.0).reshape(6, 8)
    save_file({"w": whole}, str(tmp_path / "m.safetensors"))
    torch.save({"w": whole}, tmp_path / "m.bin")
    piece = ((0, 3, 3), (1, 4, 2))  # rows 3-5, columns 4-5
    want = whole[3:6, 4:6]
    assert torch.equal(_read_piece(tmp_path / "m.safetensors", "w", piece, {}), want)
    assert torch.equal(_read_piece(tmp_path / "m.bin", "w", piece, _MappedBin(tmp_path / "m.bin")), want)
    assert torch.equal(_read_piece(tmp_path / "m.safetensors", "w", None, {}), whole)


# The chunked loss over the vocabulary shards (TP 2; FSDP2 over the 2 data-parallel ranks too) gives the loss-parallel
# cross-entropy's loss and gradients to fp32 rounding (measured: loss within 1e-6, gradients within 3e-8 of a largest
# gradient of about 0.2); a missing all-reduce of the hidden states' gradient or of the log-sum-exp is off by far more.
# A Hugging Face Llama (untied head: 21 parameters) computes the chunked loss inside its own forward, where its head
# is called, as models/hf.py runs loss=chunked_ce.
@pytest.mark.slow
@pytest.mark.parametrize(("key", "n_params"), [("chunked", 20), ("chunked_hf", 21)])
def test_chunked_ce_on_the_vocabulary_sharded_head_matches_the_loss_parallel_head(ranks, key, n_params):
    from lightning_trainopt.parallel.compat_table import TABLE

    assert TABLE["chunked_ce"]["tp"] is None
    assert TABLE["chunked_ce"]["fsdp_tp"] is None
    for seen in ranks:
        got = seen[key]
        assert got["plain"]  # a plain scalar, the same on each rank of the group, through the head's output hook
        assert got["chunked"] == pytest.approx(got["standard"], rel=1e-6)
        assert len(got["grad_diffs"]) == n_params
        assert got["scale"] > 0.05
        for name, diff in got["grad_diffs"].items():
            assert diff <= 1e-6, name


# The planner's per-rank parameters of a Hugging Face model under TP 2 (plan.py model=hf model.config=...: the model
# built on the meta device, what the plan splits read from parallel/tp.py's module names) against the elements a rank
# of the real TP model holds: GQA key/value projections, a tied (Mistral) and an untied head, Qwen2's q/k/v biases
# (split by the column-parallel layers) and the norm vectors (whole on every rank).
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_planned_per_rank_parameters_of_a_hf_model_under_tp_equal_the_real_split(ranks, arch, tmp_path):
    from lightning_trainopt.config.plan_inputs import build_plan_inputs
    from lightning_trainopt.planner import estimate_plan
    from lightning_trainopt.planner.tensor_parallel import tp_profile

    got = ranks[0]["hf_split"][arch]
    (tmp_path / "config.json").write_text(json.dumps(got["config"]))
    cfg = compose_config(
        [
            "model=hf",
            f"model.config={tmp_path}",
            "data=synthetic",
            "data.vocab_size=64",
            "data.seq_len=16",
            "+strategy=tp",
            "trainer.devices=2",
            "precision=fp32",
        ]
    )
    inputs = build_plan_inputs(cfg)
    assert inputs.tensor_parallel == 2
    assert inputs.profile.tp_shape is not None
    assert inputs.profile.tp_shape.architecture == arch
    whole = inputs.profile.n_params
    assert tp_profile(inputs.profile, 2).n_params == got["local_elements"] < whole
    planned = estimate_plan(inputs, None, None, None).memory.per_device()["params"]
    assert planned == 4 * got["local_elements"]  # fp32: 4 B per element this rank holds
    for seen in ranks[1:]:
        assert seen["hf_split"][arch]["local_elements"] == got["local_elements"]


def test_preflight_refuses_fp8_with_sequence_parallelism_on_cpu_and_passes_it_without():
    from lightning_trainopt.config.preflight import preflight_from_cfg

    base = ["+strategy=tp", "model=gpt_tiny", "data=synthetic", "trainer=ddp_sim", "precision=fp8"]
    with pytest.raises(IncompatibleConfigError, match="strategy.sequence_parallel") as err:
        preflight_from_cfg(compose_config(base))
    assert "sequence_parallel=false" in str(err.value)
    preflight_from_cfg(compose_config([*base, "strategy.sequence_parallel=false"]))
    with pytest.raises(IncompatibleConfigError, match="precision.recipe"):
        preflight_from_cfg(compose_config([*base, "strategy.sequence_parallel=false", "precision.recipe=rowwise"]))


def test_the_strategy_refuses_a_sequence_parallel_that_is_not_a_bool():
    with pytest.raises(ConfigError, match="strategy.sequence_parallel"):
        TrainOptTPStrategy(sequence_parallel="no")


@RunIf(min_cuda_gpus=2, fp8=True)
def test_fp8_with_sequence_parallelism_on_two_gpus_matches_the_fp8_model(tmp_path):
    """NCCL all-gathers float8 activations: the composition refused on gloo, run on 2 GPUs with real FP8 GEMMs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    worker = ROOT / "tests" / "unit" / "parallel" / "_tp_worker.py"
    done = subprocess.run([*cmd, str(worker), str(tmp_path), "nccl"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())["fp8_nccl"]
        assert got["sequence_parallel"]
        assert got["float8_mms"] > 0
        assert got["loss"] == pytest.approx(got["want"], rel=1e-2)  # real FP8 GEMMs, bf16 partial sums
        assert got["grad_error"] < 0.05


@pytest.mark.slow
def test_distillation_under_tp_and_fsdp2_shards_the_teacher_like_the_student(ranks):
    """experiment=distill under +strategy=fsdp_tp (TP 2 x FSDP2 2): the teacher gets the student's TP plan and
    FSDP2's shards, stays frozen and bit-identical, and the loss (vocabulary-parallel) equals one process's."""
    for seen in ranks:
        got = seen["distill"]
        assert got["teacher_head_mesh"] == ["data_parallel", "tensor_parallel"]
        assert got["teacher_head_placements"][-1] == "S(0)"  # sharded over the vocabulary on the TP dimension
        assert got["teacher_local_fraction"] == pytest.approx(0.25, abs=0.01)
        assert got["teacher_bit_identical"]
        assert got["teacher_frozen"]
        assert got["teacher_eval"]
        assert not got["teacher_in_optimizer"]
        assert got["sharded_loss"] == pytest.approx(got["reference_loss"], rel=1e-5)
        assert got["logits_width"] == got["vocab"] // 2
        assert got["train_kl"] > 0


def test_a_teacher_the_tp_size_cannot_split_is_refused_naming_the_teacher():
    """The TP step gives a distillation teacher the student's plan: a teacher with 3 heads under TP 2 is refused
    (naming distill.teacher and what does not divide), before anything is split."""
    from lightning_trainopt.parallel.apply import _tensor_parallel_teacher

    holder = torch.nn.Module()
    holder.teacher = GPT(GPTConfig(name="t3", vocab_size=64, n_layers=1, d_model=48, n_heads=3, max_seq_len=16))
    with pytest.raises(IncompatibleConfigError, match=r"distill\.teacher.*heads") as err:
        _tensor_parallel_teacher(holder, _Mesh(2), sequence_parallel=True)
    assert err.value.keys["strategy.tensor_parallel_size"] == 2
