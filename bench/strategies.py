"""Every strategy preset on the same model: step time, per-rank memory breakdown, checkpoint size, ratio to DDP.

CPU (development machines), 2 gloo processes per preset and 1 process for the sharding comparison::

    cd /work/main && python bench/strategies.py --devices 2 --compare-single

GPU (one H200-class device, ~1B model)::

    python bench/strategies.py --accelerator gpu --devices 1 --model gpt_1b --seq-len 1024 --batch-size 4 \
        --precision bf16-mixed --presets ddp zero1 zero2 zero2_offload zero3 zero3_offload

With ``--val-every N`` each fit validates every N steps and once more after ``fit`` (as train.py's final validation
does), reporting ``val_losses`` by step and ``post_fit_val_loss``.

One preset alone (used by the integration tests; writes a JSON report on rank 0)::

    python bench/strategies.py --single zero3 --devices 2 --out /tmp/r.json

Several presets one after another in the same process group (one launch, one process start-up; the JSON then maps
each preset to its report; ``--save-to DIR`` saves each preset's checkpoint under ``DIR/PRESET`` and
``--drop-checkpoints`` deletes it once its size is measured; ``--ckpt-dir`` and ``--resume`` take a ``{preset}``
placeholder)::

    python bench/strategies.py --single ddp zero1 zero2 --devices 2 --precision 32-true --out /tmp/r.json
    python bench/strategies.py --single ddp zero3 --devices 2 --ckpt-dir 'ck/{preset}' --epoch-batches 3 --out a.json
    python bench/strategies.py --single ddp zero3 --devices 2 --resume 'ck/{preset}/step3.ckpt' --epoch-batches 3 \
        --out b.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU_PRESETS = ["ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
# Small buckets so DeepSpeed does not allocate 50M-element communication buffers per rank on a CPU run.
_CPU_OVERRIDES = {"allgather_bucket_size": 2_000_000, "reduce_bucket_size": 2_000_000}


def _dir_bytes(path: str) -> int:
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def run_single(args: argparse.Namespace) -> None:
    """Fit each ``--single`` preset in turn in this process group and write one JSON report from rank 0.

    Lightning's launcher starts ranks 1.. on the first fit by re-running this script with the same argv, so every
    rank runs the same presets in the same order. Between fits the process group (DeepSpeed's included) is
    destroyed; the launcher's environment (``LOCAL_RANK``, ``MASTER_PORT``, ...) stays, so the next fit joins the
    same ranks on the same port instead of starting new processes.
    """
    presets = args.single
    for flag, value in (("--ckpt-dir", args.ckpt_dir), ("--resume", args.resume)):
        if len(presets) > 1 and value and "{preset}" not in value:
            raise SystemExit(f"{flag} with several presets needs a {{preset}} placeholder, e.g. ck/{{preset}}")
    reports: dict[str, Any] = {}
    for preset in presets:
        save_to = args.save_to and (args.save_to if len(presets) == 1 else str(Path(args.save_to) / preset))
        paths = {
            "ckpt_dir": args.ckpt_dir and args.ckpt_dir.replace("{preset}", preset),
            "resume": args.resume and args.resume.replace("{preset}", preset),
        }
        report = _fit_one(argparse.Namespace(**{**vars(args), **paths}), preset, save_to)
        if report is not None:
            reports[preset] = report
        _release_process_group()
    if reports:
        out = reports[presets[0]] if len(presets) == 1 else reports
        Path(args.out).write_text(json.dumps(out, indent=1))


def _release_process_group() -> None:
    """Destroy the process group so the next fit initialises a fresh one, on a fresh port.

    DeepSpeed caches its groups in module globals, so its own ``destroy_process_group`` is used when it is loaded.
    The next fit must not reuse ``MASTER_PORT``: a store left from a DeepSpeed group on that port hands the new
    group stale peer addresses (measured: gloo ``connectFullMesh ... Connection refused``). Rank 0 picks a free port
    and broadcasts it while the old group still exists.
    """
    import gc

    import torch
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        port = [find_free_network_port() if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(port, src=0)
        os.environ["MASTER_PORT"] = str(port[0])
        ds_comm = sys.modules.get("deepspeed.comm")
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()
        else:
            torch.distributed.destroy_process_group()
    gc.collect()


def _fit_one(args: argparse.Namespace, preset: str, save_to: str | None) -> dict[str, Any] | None:
    """Fit one preset; the report on rank 0, ``None`` on the other ranks."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from omegaconf import OmegaConf

    from lightning_trainopt.config.strategy import build_strategy
    from lightning_trainopt.data.datamodule import TextDataModule
    from lightning_trainopt.models import GPTConfig, LitGPT
    from lightning_trainopt.parallel.report import StrategyReport
    from lightning_trainopt.precision import PrecisionSpec

    class Losses(Callback):
        def __init__(self) -> None:
            self.losses: dict[int, float] = {}
            self.times: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._t)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses[trainer.global_step] = float(loss.detach().float())

    pl.seed_everything(args.seed, workers=True)
    cfg = OmegaConf.load(ROOT / "lightning_trainopt" / "conf" / "strategy" / f"{preset}.yaml")
    if args.accelerator == "cpu" and "deepspeed" in str(cfg._target_).lower():
        for k, v in _CPU_OVERRIDES.items():
            if k in cfg:
                cfg[k] = v
    for item in args.set or []:
        key, value = item.split("=", 1)
        cfg[key] = json.loads(value) if value[:1] in "[{0123456789-tfn" else value
    spec = PrecisionSpec(name=args.precision, trainer_precision=args.precision)
    trainer_cfg = {"accumulate_grad_batches": args.accumulate, "gradient_clip_val": 1.0}
    strategy = build_strategy(cfg, spec, trainer_cfg, micro_batch_size=args.batch_size)
    if args.model == "bench":
        model_cfg = GPTConfig(
            name="bench", vocab_size=256, n_layers=4, d_model=256, n_heads=4, ffn_hidden=688, max_seq_len=args.seq_len
        )
    else:
        model_cfg = GPTConfig(
            **{
                k: v
                for k, v in OmegaConf.to_container(
                    OmegaConf.load(ROOT / "lightning_trainopt" / "conf" / "model" / f"{args.model}.yaml")
                ).items()
                if k != "_target_"
            }
        )
    module = LitGPT(model_cfg)
    dm = TextDataModule(
        corpus="synthetic",
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        vocab_size=model_cfg.vocab_size,
        seed=args.seed,
    )

    class ValLosses(Callback):
        """``val_loss`` of each validation inside ``fit``, by the step it ran at."""

        def __init__(self) -> None:
            self.losses: dict[int, float] = {}

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            if trainer.state.fn == "fit" and not trainer.sanity_checking:
                self.losses[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    losses, report, val_losses = Losses(), StrategyReport(at_step=1), ValLosses()
    callbacks: list[Any] = [losses, report, val_losses]
    if args.ckpt_dir:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.ckpt_dir,
                filename="step{step}",
                every_n_train_steps=args.ckpt_every,
                save_top_k=-1,
                save_last=False,
                auto_insert_metric_name=False,
            )
        )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        limit_train_batches=args.epoch_batches or 1.0,
        limit_val_batches=args.val_batches if args.val_every else 0,
        val_check_interval=args.val_every or None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        accumulate_grad_batches=args.accumulate,
        deterministic=True,
        callbacks=callbacks,
    )
    trainer.fit(module, dm, ckpt_path=args.resume)
    post_fit_val = None
    if args.val_every:
        # What train.py's final validation does after fit: the strategy sets the trained model up again.
        post_fit_val = float(trainer.validate(module, dm, verbose=False)[0]["val_loss"])
    ckpt_bytes = None
    if save_to:
        trainer.save_checkpoint(save_to)
        trainer.strategy.barrier()
        ckpt_bytes = _dir_bytes(save_to)
        if args.drop_checkpoints:
            # Measured; a ~1B model's checkpoint is ~15 GB, so several presets would fill a GPU machine's disk.
            trainer.strategy.barrier()
            if trainer.is_global_zero and os.path.isdir(save_to):
                shutil.rmtree(save_to)
            elif trainer.is_global_zero:
                os.remove(save_to)
    if not trainer.is_global_zero:
        return None
    steady = losses.times[2:] or losses.times
    return {
        **report.summary(),
        "preset": preset,
        "devices": args.devices,
        "precision": args.precision,
        "n_params": model_cfg.n_params(),
        "losses": losses.losses,
        "val_losses": val_losses.losses,
        "post_fit_val_loss": post_fit_val,
        "step_time_s": sum(steady) / max(len(steady), 1),
        "checkpoint_bytes": ckpt_bytes,
        "torch": torch.__version__,
    }


def _launch(presets: list[str], devices: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Run ``presets`` one after another in one process group of ``devices`` processes; reports by preset."""
    out = tmp / f"reports_{devices}.json"
    cmd = [
        sys.executable,
        __file__,
        "--single",
        *presets,
        "--devices",
        str(devices),
        "--out",
        str(out),
        "--accelerator",
        args.accelerator,
        "--precision",
        args.precision,
        "--model",
        args.model,
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.max_steps),
        "--save-to",
        str(tmp / f"ckpt_{devices}" / presets[0] if len(presets) == 1 else tmp / f"ckpt_{devices}"),
        "--drop-checkpoints",
    ]
    # Put the repository first on PYTHONPATH, keeping what is there (a bare GPU image gets Hydra/DeepSpeed that way).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"{presets} on {devices} process(es) failed (rc={proc.returncode})")
    reports = json.loads(out.read_text())
    return {presets[0]: reports} if len(presets) == 1 else reports


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", nargs="+", help="run these presets in one process group and write --out")
    parser.add_argument("--presets", nargs="+", default=CPU_PRESETS)
    parser.add_argument("--compare-single", action="store_true", help="also run every preset on 1 process")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--model", default="bench", help="'bench' (4x256, 3.4M params) or a conf/model name")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epoch-batches", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps in fit, then once after it")
    parser.add_argument("--val-batches", type=int, default=2)
    parser.add_argument("--ckpt-dir")
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--resume")
    parser.add_argument("--save-to")
    parser.add_argument("--drop-checkpoints", action="store_true", help="delete each --save-to checkpoint once sized")
    parser.add_argument("--set", nargs="*", help="strategy overrides key=value")
    parser.add_argument("--out", default="strategies.json")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--workdir", default="/tmp/trainopt_bench_strategies")
    args = parser.parse_args()
    if args.single:
        run_single(args)
        return

    tmp = Path(args.workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    many = _launch(args.presets, args.devices, args, tmp)
    print(f"done: {args.presets} on {args.devices} process(es)", file=sys.stderr)
    one = _launch(args.presets, 1, args, tmp) if args.compare_single else {}
    rows = [(preset, many[preset], one.get(preset)) for preset in args.presets]
    base = rows[0][1] if rows and rows[0][0] == "ddp" else None
    header = (
        f"| preset | ZeRO | step s | params dev/cpu MiB | grads dev/cpu MiB | optim dev/cpu MiB | ckpt MiB "
        f"| total vs DDP |{' 1-proc params/grads/optim MiB | N/1 params/grads/optim |' if args.compare_single else ''}"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for preset, r, r1 in rows:
        mb = r["memory_breakdown"]
        total = sum(v for c in mb.values() for v in c.values())
        ratio = "-"
        if base is not None:
            base_total = sum(v for c in base["memory_breakdown"].values() for v in c.values())
            ratio = f"{total / base_total:.2f}"
        cells = [preset, str(r["zero_stage"]), f"{r['step_time_s']:.3f}"]
        for cat in ("params", "grads", "optimizer_states"):
            cells.append(f"{_mib(mb[cat]['device'])} / {_mib(mb[cat]['cpu'])}")
        cells += [_mib(r["checkpoint_bytes"]), ratio]
        if r1 is not None:
            m1 = r1["memory_breakdown"]
            cats = ("params", "grads", "optimizer_states")
            cells.append(" / ".join(_mib(sum(m1[c].values())) for c in cats))
            cells.append(" / ".join(f"{sum(mb[c].values()) / max(sum(m1[c].values()), 1):.3f}" for c in cats))
        print("| " + " | ".join(cells) + " |")
    Path(args.out).write_text(json.dumps([{"preset": p, "n": r, "one": r1} for p, r, r1 in rows], indent=1))


if __name__ == "__main__":
    main()
