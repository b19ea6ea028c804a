"""Every config key is bound to the signature of what it is passed to before anything is built, all errors at once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from lightning_trainopt.config.keys import key_problems
from lightning_trainopt.config.plan_command import plan_choices
from lightning_trainopt.config.validate import validate_config
from lightning_trainopt.exceptions import ConfigKeysError
from lightning_trainopt.launch import cli
from lightning_trainopt.launch.cli import CONFIG_DIR
from tests.helpers.compose import compose_config

CONF = Path(CONFIG_DIR)


def _options(conf: Path) -> dict[str, list[str]]:
    """Every option of every config group under ``conf`` (nested groups such as experiment/ladder_rung too)."""
    out: dict[str, list[str]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        group = path.parent.relative_to(conf).as_posix()
        if group != "." and group.split("/")[0] != "hydra":
            out.setdefault(group, []).append(path.stem)
    return out


def _compose(conf: Path, overrides: list[str], name: str = "train") -> DictConfig:
    with initialize_config_dir(version_base="1.3", config_dir=str(conf)):
        return compose(name, overrides=overrides, return_hydra_config=True)


def _compose_and_bind(conf: Path, options: dict[str, list[str]]) -> list[str]:
    """Compose every option, one option of several groups per composition, and bind each config; every failure.

    A ``@package _global_`` option (an experiment, a ladder rung, debug) sets other groups itself, so it is composed
    on its own; a group that is not in the defaults list (``strategy``) is appended with ``+``.
    """
    in_defaults = set(_compose(conf, []).hydra.runtime.choices)

    def override(group: str, option: str) -> str:
        return f"{group}={option}" if group in in_defaults else f"+{group}={option}"

    def alone(group: str, option: str) -> bool:
        return "@package _global_" in (conf / group / f"{option}.yaml").read_text().split("\n", 1)[0]

    solo = [[override(g, o)] for g, opts in options.items() for o in opts if alone(g, o)]
    rest = {g: [o for o in opts if not alone(g, o)] for g, opts in options.items()}
    rounds = max((len(opts) for opts in rest.values()), default=0)
    batches = solo + [[override(g, opts[i]) for g, opts in rest.items() if i < len(opts)] for i in range(rounds)]
    errors: list[str] = []
    for batch in batches:
        try:
            cfg = _compose(conf, batch)
        except Exception:
            for one in batch:  # which option does not compose
                try:
                    _compose(conf, [one])
                except Exception as err:
                    errors.append(f"{one}: does not compose: {type(err).__name__}: {err}")
            continue
        errors.extend(f"{' '.join(batch)}: {key}={value!r}: {fix}" for key, value, fix in key_problems(cfg))
    return errors


def test_every_option_of_every_group_composes_and_binds():
    options = _options(CONF)
    # Discovered from the files, so a new preset is checked without touching this test.
    assert "llama_7b" in options["model"]
    assert "zero2" in options["experiment/ladder_rung"]
    assert "profiler" in options["debug"]
    errors = _compose_and_bind(CONF, options)
    assert not errors, "\n".join(errors)
    assert not key_problems(_compose(CONF, [], name="plan"))


def test_a_new_preset_with_a_misspelt_key_fails_the_check(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "callbacks" / "typo_timer.yaml").write_text(
        "typo_timer:\n  _target_: lightning_trainopt.callbacks.StepTimer\n  warmup_step: 3\n"
    )
    options = _options(conf)
    assert "typo_timer" in options["callbacks"]
    errors = _compose_and_bind(conf, {"callbacks": options["callbacks"]})
    assert errors == [
        "callbacks=typo_timer: callbacks.typo_timer.warmup_step=3: unknown argument of "
        "lightning_trainopt.callbacks.StepTimer; did you mean warmup_steps?"
    ]


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["+callbacks.speed_monitor.warmup_step=2"],
            "callbacks.speed_monitor.warmup_step=2: unknown argument of lightning_trainopt.callbacks.SpeedMonitor; "
            "did you mean warmup_steps?",
        ),
        (
            ["+optimizer.betaz=[0.9,0.9]"],
            "optimizer.betaz=[0.9, 0.9]: unknown argument of torch.optim.AdamW; did you mean betas?",
        ),
        (
            ["+data.batchsize=8"],
            "data.batchsize=8: unknown argument of lightning_trainopt.data.TextDataModule; did you mean batch_size?",
        ),
        (
            ["+trainer.max_step=20"],
            "trainer.max_step=20: unknown argument of lightning.pytorch.Trainer; did you mean max_steps?",
        ),
        # **kwargs that go on to a known callable: torch's DDP, Lightning's DeepSpeedStrategy and ModelCheckpoint
        # (the base classes of ours), bitsandbytes' arguments, torch's profiler.
        (
            ["+strategy=ddp", "+strategy.find_unused_parameter=true"],
            "strategy.find_unused_parameter=True: unknown argument of lightning_trainopt.parallel.TrainOptDDPStrategy; "
            "did you mean find_unused_parameters?",
        ),
        (
            ["+strategy=zero2", "+strategy.offload_optimiser=true"],
            "strategy.offload_optimiser=True: unknown argument of "
            "lightning_trainopt.parallel.TrainOptDeepSpeedStrategy; did you mean offload_optimizer?",
        ),
        (
            ["+callbacks.model_checkpoint.every_n_train_step=3"],
            "callbacks.model_checkpoint.every_n_train_step=3: unknown argument of "
            "lightning_trainopt.callbacks.ResumableCheckpoint; did you mean every_n_train_steps?",
        ),
        (
            ["optimizer=adamw8bit", "+optimizer.amsgrad=true"],
            "optimizer.amsgrad=True: unknown argument of lightning_trainopt.optim.optimizers.bnb_adamw8bit; "
            "it takes betas, eps, lr, min_8bit_size, weight_decay.",
        ),
        (
            ["debug=profiler", "+trainer.profiler.with_stak=true"],
            "trainer.profiler.with_stak=True: unknown argument of lightning.pytorch.profilers.PyTorchProfiler; "
            "did you mean with_stack?",
        ),
        (
            ["+scheduler.total_steps=5"],
            "scheduler.total_steps=5: the app passes this argument of lightning_trainopt.models.lit_gpt.warmup_cosine "
            "itself; remove it.",
        ),
        (
            ["+callbacks.speed_monitr.warmup_steps=2"],
            "callbacks.speed_monitr={'warmup_steps': 2}: not a callback: it has no _target_, so nothing would be built "
            "from it; did you mean callbacks.speed_monitor?",
        ),
        (
            ["+callbacks.timer._target_=lightning_trainopt.callbacks.StepTimr"],
            "callbacks.timer._target_='lightning_trainopt.callbacks.StepTimr': cannot be imported: "
            "lightning_trainopt.callbacks has no StepTimr; did you mean StepTimer?",
        ),
        (
            ["+sead=1"],
            "sead=1: no such top-level key; did you mean seed? The top-level settings are ckpt_path, compile, "
            "continue_on_oom, seed, task_name; a group's key goes under it (data.seed).",
        ),
        (
            ["~precision.trainer_precision"],
            "precision.trainer_precision=???: missing argument of lightning_trainopt.precision.PrecisionSpec; "
            "add +precision.trainer_precision=...",
        ),
    ],
)
def test_a_key_its_target_does_not_take_is_refused_with_the_nearest_valid_one(tmp_path, overrides, line):
    cfg = compose_config([*overrides, "trainer.accelerator=cpu"], tmp_path)
    with pytest.raises(ConfigKeysError) as err:
        validate_config(cfg)
    assert str(err.value) == line


def test_plan_py_takes_its_plan_node_and_an_unknown_one_is_refused(tmp_path):
    assert not key_problems(compose_config([], tmp_path, name="plan"))
    # A train config with a plan node is planned (the ladder predicts each rung so).
    assert not key_problems(compose_config(["+plan.choices={}"], tmp_path))
    problems = key_problems(compose_config(["+plna.top_k=3"], tmp_path))
    assert [(key, fix.split(";")[0]) for key, _, fix in problems] == [("plna", "no such top-level key")]


def test_every_misspelt_key_is_reported_at_once(tmp_path):
    typos = ["+callbacks.speed_monitor.warmup_step=2", "+optimizer.betaz=[0.9,0.9]", "+data.batchsize=8"]
    with pytest.raises(ConfigKeysError) as err:
        validate_config(compose_config([*typos, "trainer.max_steps=0"], tmp_path))
    # All the misspelt keys, in the config's order; the bad value (max_steps=0) is checked once they are fixed.
    lines = str(err.value).splitlines()
    assert lines[0] == "3 config keys do not fit their targets:"
    assert [line.split(":", 1)[0] for line in lines[1:]] == [
        "  data.batchsize=8",
        "  optimizer.betaz=[0.9, 0.9]",
        "  callbacks.speed_monitor.warmup_step=2",
    ]
    assert [key for key, _, _ in err.value.problems] == [line.strip().split("=")[0] for line in lines[1:]]
    assert "did you mean warmup_steps?" in lines[3]


def test_a_target_that_needs_a_missing_package_is_left_to_the_preflight(tmp_path, monkeypatch):
    # The pre-flight check refuses a missing package with its pip command; here it is skipped, not a crash.
    (tmp_path / "needs_absent_pkg.py").write_text("import absent_pkg_for_this_test\n\nclass Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = OmegaConf.create(
        {
            "callbacks": {
                "a": {"_target_": "needs_absent_pkg.Thing", "any_key": 1},
                "b": {"_target_": "absent_pkg_for_this_test.Thing", "any_key": 1},
                # A misspelt module of an installed package is reported, not skipped.
                "c": {"_target_": "lightning_trainopt.callbackz.StepTimer"},
            }
        }
    )
    assert key_problems(cfg) == [
        (
            "callbacks.c._target_",
            "lightning_trainopt.callbackz.StepTimer",
            "cannot be imported: lightning_trainopt has no callbackz; did you mean callbacks?",
        )
    ]


@pytest.mark.parametrize(("preset", "name"), [("ddp", "ddp"), ("zero2", "zero2"), ("fsdp_offload", "fsdp_offload")])
def test_a_strategy_preset_is_named_without_a_name_key(monkeypatch, preset, name):
    # Strategy presets carry `preset:` (an argument of our strategies).
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # as an API caller without @hydra.main
    node = OmegaConf.load(CONF / "strategy" / f"{preset}.yaml")
    assert "name" not in node
    assert plan_choices(OmegaConf.create({"strategy": node}))["strategy"] == name


def _hydra_error(overrides: list[str]) -> Exception:
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR), pytest.raises(HydraException) as err:
        compose("train", overrides=overrides)
    return err.value


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("strategy=zero3", "strategy=zero3: strategy is not in the defaults list; add it with a +: +strategy=zero3"),
        (
            "trainer.max_step=20",
            "trainer.max_step=20: unknown argument of lightning.pytorch.Trainer; did you mean max_steps?",
        ),
        (
            "callbacks.speed_monitor.warmup_step=2",
            "callbacks.speed_monitor.warmup_step=2: unknown argument of lightning_trainopt.callbacks.SpeedMonitor; "
            "did you mean warmup_steps?",
        ),
        (
            "trainer.gradient_clip_algorithm=norm",
            "trainer.gradient_clip_algorithm=norm: trainer.gradient_clip_algorithm is not in the config yet; add it "
            "with a +: +trainer.gradient_clip_algorithm=norm",
        ),
        (
            "trainer.precision=16-mixed",
            "trainer.precision=16-mixed: train.py sets this Trainer argument; remove it and choose the precision group "
            "instead, e.g. precision=bf16 (presets in conf/precision/).",
        ),
        (
            "+trainer.max_steps=5",
            "+trainer.max_steps=5: trainer.max_steps is already in the config; override it without the +: "
            "trainer.max_steps=5",
        ),
        ("sead=3", "sead=3: no such key; did you mean seed?"),
        (
            "+strategy=zero9",
            "strategy=zero9: no such preset; did you mean strategy=zero3? conf/strategy/ has ddp, deepspeed_json, "
            "fsdp, fsdp_offload, fsdp_tp, tp, zero1, zero2, zero2_offload, zero3, zero3_offload, zero_infinity.",
        ),
    ],
)
def test_hydras_override_errors_become_one_line(override, line):
    assert cli.hydra_error_line(_hydra_error([override])) == line


def test_other_hydra_errors_keep_hydras_report():
    assert cli.hydra_error_line(_hydra_error(["trainer.max_steps=[1"])) is None  # a parse error: Hydra says where
    assert cli.hydra_error_line(ValueError("Could not override 'x'.")) is None
