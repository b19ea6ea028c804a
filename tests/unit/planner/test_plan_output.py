"""What plan() reports: next step when it does not fit, DDP on one device, resident bytes, top_k, defaults, sweeps."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from lightning_trainopt.config.plan import plan, plan_task
from lightning_trainopt.config.plan_command import PlanSweepCheck
from lightning_trainopt.planner import LOCATIONS
from lightning_trainopt.planner.report import refused_jobs
from tests.helpers.compose import compose_config

ZERO2 = ["model=llama_7b", "hardware=a100_80gb", "trainer.devices=4", "+strategy=zero2", "precision=bf16"]
# 7B with AdamW on one 80 GB device: 16 B/param of model states alone, ~108 GB.
TOO_BIG = ["model=llama_7b", "hardware=a100_80gb", "trainer.devices=1", "precision=bf16", "data.batch_size=1"]


def test_a_config_that_does_not_fit_gets_a_next_step_that_fits(tmp_path):
    result = plan(compose_config(TOO_BIG, tmp_path, name="plan"))
    assert result.estimate.fits is False
    assert result.next_step
    command = result.next_step.split("fits: ", 1)[1].split("  (or", 1)[0]
    assert command.startswith("python train.py ")
    suggested = plan(compose_config([*command.split()[2:], "plan.format=json"], tmp_path, name="plan"))
    assert suggested.estimate.fits is True
    assert result.to_dict()["next_step"] == result.next_step


def test_the_python_api_with_partial_choices_gets_a_next_step(tmp_path):
    # The notebook sets plan.choices to the groups it overrides only (no optimizer): the next-step search must take
    # the composed config's optimizer, not fail with a KeyError.
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from lightning_trainopt.launch.cli import CONFIG_DIR

    HydraConfig.instance().cfg = None  # as in a notebook: no @hydra.main, so no runtime choices
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        cfg = compose("plan", overrides=TOO_BIG)
    cfg.plan.choices = {"model": "llama_7b", "hardware": "a100_80gb", "precision": "bf16"}
    result = plan(cfg)
    assert result.estimate.fits is False
    assert "fits: python train.py " in result.next_step


def test_the_rich_screen_prints_the_next_step_not_run_it(tmp_path, capsys):
    plan_task(compose_config(TOO_BIG, tmp_path, name="plan"))
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    assert "next step:" in out
    assert "run it:" not in out


def test_a_config_that_fits_has_no_next_step(tmp_path, capsys):
    result = plan_task(compose_config([*ZERO2, "activations=checkpoint"], tmp_path, name="plan"))
    assert result.estimate.fits is True
    assert result.to_dict()["next_step"] is None
    assert "run it: " in capsys.readouterr().out


def test_the_ddp_preset_on_one_device_is_planned_as_ddp(tmp_path):
    result = plan(
        compose_config(
            ["model=gpt_125m", "hardware=a100_80gb", "trainer.devices=1", "+strategy=ddp"], tmp_path, name="plan"
        )
    )
    assert result.estimate.inputs.layout.kind == "ddp"
    assert "+strategy=ddp" in result.command


def test_the_ddp_preset_on_one_device_counts_the_gradient_buckets(tmp_path):
    result = plan(
        compose_config(
            ["model=gpt_125m", "hardware=a100_80gb", "trainer.devices=1", "+strategy=ddp"], tmp_path, name="plan"
        )
    )
    labels = {t.label: t.nbytes for t in result.estimate.memory.terms}
    assert labels["DDP gradient buckets"] == 4 * result.estimate.inputs.model.n_params()


def test_a_search_on_one_device_offers_no_strategy_instead_of_ddp(tmp_path):
    overrides = [
        "model=gpt_125m",
        "hardware=a100_80gb",
        "trainer.devices=1",
        "+strategy=ddp",
        "precision=bf16",
        "data.batch_size=1",
        "plan.search=true",
        "plan.search_space.micro_batch=[1]",
        "plan.search_space.activations=[none]",
    ]
    result = plan(compose_config(overrides, tmp_path, name="plan"))
    strategies = {c.choices["strategy"] for c in result.candidates}
    assert "none" in strategies
    assert "ddp" not in strategies
    assert result.winner.choices["strategy"] == "none"
    assert "+strategy" not in result.command  # the user's +strategy=ddp is replaced by Lightning's single device


def test_memory_breakdown_shows_resident_bytes_and_transients_apart(tmp_path):
    result = plan(compose_config([*ZERO2, "activations=checkpoint"], tmp_path, name="plan"))
    d = result.to_dict()
    mem = result.estimate.memory
    n, w = d["n_params"], 4
    for c in ("params", "grads", "optimizer_states"):
        for loc in LOCATIONS:
            assert d["memory_breakdown"][c][loc] + d["memory_transient"][c][loc] == mem.bytes(c, loc)
            assert d["memory_breakdown"][c][loc] == mem.bytes(c, loc, resident_only=True)
    # DeepSpeed's fp32 gradient partition exists only inside step(): transient, not in the snapshot.
    assert d["memory_transient"]["grads"]["device"] == 4 * n // w
    assert d["memory_breakdown"]["grads"]["device"] == d["per_device_bytes"]["grads"] - 4 * n // w
    assert d["peak_bytes"] == 50_587_140_104  # the headline figure is unchanged


@pytest.mark.parametrize("top_k", [3, 14])
def test_json_search_rows_follow_top_k(tmp_path, top_k):
    overrides = [
        *ZERO2,
        "data.batch_size=1",
        "plan.search=true",
        "plan.search_space.micro_batch=[1]",
        f"plan.top_k={top_k}",
    ]
    result = plan(compose_config(overrides, tmp_path, name="plan"))
    assert len(result.candidates) > 14
    assert len(result.to_dict()["search"]["top"]) == top_k


def test_plan_without_a_plan_node_keeps_the_documented_headroom(tmp_path):
    cfg = compose_config([*ZERO2, "activations=checkpoint", "data.seq_len=2048"], tmp_path, name="train")
    assert cfg.get("plan") is None
    result = plan(cfg)
    assert result.estimate.headroom_bytes == int(0.05 * 80 * 2**30)


def _sweep(tmp_path, jobs: dict[str, dict | None]):
    for job, metrics in jobs.items():
        (tmp_path / job).mkdir()
        if metrics is not None:
            (tmp_path / job / "metrics.json").write_text(json.dumps(metrics))
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})


def _ended(check: PlanSweepCheck, config, n_jobs: int) -> None:
    for _ in range(n_jobs):
        check.on_job_end(config, job_return=None)
    check.on_multirun_end(config)


def test_a_plan_sweep_exits_2_only_when_no_job_was_planned(tmp_path, capsys):
    refused = {"status": "refused", "error": "trainer.devices=0 is invalid"}
    failed = {"status": "failed", "error": "KeyError: 'x'"}
    config = _sweep(tmp_path, {"0": refused, "1": None, "2": failed})
    assert refused_jobs(tmp_path) == {"0": "refused: trainer.devices=0 is invalid", "2": "failed: KeyError: 'x'"}
    _ended(PlanSweepCheck(), config, 3)  # job 1 was planned: the sweep is an answer
    err = capsys.readouterr().err
    assert "job 0 refused: trainer.devices=0 is invalid" in err
    assert "job 2 failed: KeyError: 'x'" in err
    assert "2 of 3 plan job(s)" in err
    (tmp_path / "1" / "metrics.json").write_text(json.dumps(failed))
    with pytest.raises(SystemExit) as exit_info:
        _ended(PlanSweepCheck(), config, 3)  # a crash is not a plan either
    assert exit_info.value.code == 2


def test_a_plan_sweep_without_refusals_ends_normally(tmp_path):
    config = _sweep(tmp_path, {"0": None, "1": None})
    assert PlanSweepCheck().on_multirun_end(config) is None


def test_a_search_where_nothing_fits_says_what_to_search_next(tmp_path, capsys):
    overrides = [
        *ZERO2,
        "hardware.memory_gb=1",
        "data.batch_size=1",
        "plan.search=true",
        "plan.search_space.micro_batch=[1]",
        "plan.search_space.activations=[none]",
    ]
    result = plan_task(compose_config(overrides, tmp_path, name="plan"))
    assert result.n_enumerated > 0
    assert result.candidates == []
    out = capsys.readouterr().out.replace("\n", " ")
    assert "no configuration fits on 4 x a100_80gb" in out
    assert "trainer.devices=8 plan.search=true" in out


# ZeRO-3 with parameters and optimizer offloaded to CPU: 7B on 8 devices puts ~126 GiB of states in a node's RAM.
OFFLOAD = ["model=llama_7b", "hardware=a100_80gb", "trainer.devices=8", "+strategy=zero3_offload", "precision=bf16"]


def test_offloaded_bytes_are_checked_against_the_nodes_ram(tmp_path):
    d = plan(compose_config([*OFFLOAD, "activations=checkpoint"], tmp_path, name="plan")).to_dict()
    assert d["cpu_bytes"] > 0
    assert d["host_bytes_per_node"] == 8 * d["cpu_bytes"]
    assert d["host_memory_bytes"] == 1152 * 2**30  # the preset's reference node (p4de.24xlarge)
    assert d["host_fits"] is True
    assert d["device_fits"] is True
    assert d["fits"] is True
    # The same run on a node with 64 GiB of RAM: the devices have room, the host has not.
    small = plan(
        compose_config([*OFFLOAD, "activations=checkpoint", "hardware.host_memory_gb=64"], tmp_path, name="plan")
    )
    e = small.estimate
    assert e.device_fits is True
    assert e.host_bytes_per_node > e.host_usable_bytes == 64 * 2**30 - int(0.05 * 64 * 2**30)
    assert e.host_fits is False
    assert e.fits is False
    # The next step leaves the offload: a strategy that fits the devices without the host's RAM.
    command = small.next_step.split("fits: ", 1)[1].split("  (or", 1)[0]
    suggested = plan(compose_config([*command.split()[2:]], tmp_path, name="plan"))
    assert suggested.estimate.fits is True
    assert suggested.estimate.host_bytes_per_node <= suggested.estimate.host_usable_bytes


def test_without_offload_the_host_check_passes_and_prints_nothing(tmp_path, capsys):
    result = plan_task(
        compose_config([*ZERO2, "activations=checkpoint", "hardware.host_memory_gb=1"], tmp_path, name="plan")
    )
    assert result.estimate.host_bytes_per_node == 0
    assert result.estimate.host_fits is True
    assert result.estimate.fits is True
    assert "host RAM" not in capsys.readouterr().out


def test_the_rich_screen_gives_the_host_verdict(tmp_path, capsys):
    plan_task(compose_config([*OFFLOAD, "hardware.host_memory_gb=64"], tmp_path, name="plan"))
    out = " ".join(capsys.readouterr().out.split())
    assert "host RAM does NOT fit" in out
    assert "of 60.80 GiB usable (64.00 GiB less 5% for the processes; user-set)" in out
    plan_task(compose_config([*OFFLOAD, "hardware=h100_pcie"], tmp_path, name="plan"))
    out = " ".join(capsys.readouterr().out.split())
    assert "RAM of a node unknown: set hardware.host_memory_gb" in out


def test_the_search_drops_offload_plans_the_host_cannot_hold(tmp_path):
    space = "plan.search_space.strategy=[zero3_offload,zero2_offload,zero3]"
    roomy = plan(compose_config([*OFFLOAD, "plan.search=true", space], tmp_path, name="plan"))
    tight = plan(
        compose_config([*OFFLOAD, "plan.search=true", space, "hardware.host_memory_gb=64"], tmp_path, name="plan")
    )
    strategies = lambda r: {c.choices["strategy"] for c in r.candidates}  # noqa: E731
    assert "zero3_offload" in strategies(roomy)
    assert "zero3_offload" not in strategies(tight)
    assert all(c.estimate.host_fits is not False for c in tight.candidates)


def test_when_the_host_is_what_does_not_fit_the_next_step_adds_nodes(tmp_path):
    # 13B under ZeRO-3 CPU offload: 30.3 GiB per rank, 242 GiB per 8-GPU node, on nodes with 150 GiB of RAM. More
    # GPUs in the same node would hold the same 242 GiB: only more nodes divide it.
    cfg = [
        "model=llama_13b",
        "hardware=a100_40gb",
        "trainer.devices=8",
        "+strategy=zero3_offload",
        "precision=bf16",
        "hardware.host_memory_gb=150",
    ]
    result = plan(compose_config(cfg, tmp_path, name="plan"))
    assert result.estimate.host_fits is False
    assert "(2 nodes)" in result.next_step
    command = result.next_step.split("fits: ", 1)[1].split("  (or", 1)[0]
    assert "trainer.num_nodes=2" in command
    assert "trainer.devices=8" in command
    suggested = plan(compose_config(command.split()[2:], tmp_path, name="plan"))
    assert suggested.estimate.host_fits is True
    assert suggested.estimate.fits is True


def test_on_a_cpu_device_the_peak_counts_against_the_hosts_ram(tmp_path):
    # hardware=cpu with a given RAM: the "device" is the CPU, so each rank's peak is host RAM too.
    cfg = ["model=gpt_350m", "hardware=cpu", "trainer.devices=2", "data.batch_size=32", "data.seq_len=1024"]
    small = plan(compose_config([*cfg, "hardware.host_memory_gb=8"], tmp_path, name="plan")).estimate
    assert small.memory.bytes(location="cpu") == 0
    assert small.host_bytes_per_node == 2 * small.peak_device_bytes
    assert small.host_fits is False
    assert small.fits is False
    roomy = plan(compose_config([*cfg, "hardware.host_memory_gb=1024"], tmp_path, name="plan")).estimate
    assert roomy.host_fits is True
    assert roomy.fits is None  # no device memory figure for the CPU itself
