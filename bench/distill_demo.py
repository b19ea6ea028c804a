"""Distillation demo on CPU: a gpt_tiny student distilled from a larger teacher vs the same student trained alone.

Three ``python train.py`` runs on the standard-library corpus (``data=stdlib_text``, the project's default data):

1. the teacher (4 layers, d_model 256: 3.2M parameters, 4x the student) trained for ``--teacher-steps`` steps;
2. the student alone (``model=gpt_tiny``), ``--steps`` steps;
3. the same student, same seed and data, with ``experiment=distill distill.teacher=<1's last.ckpt>``.

Both students' validation cross-entropy (``val_loss``: the student's CE in both runs) is read from their CSV logs,
printed as a table and plotted in one figure (``bench/distill_demo.png``; without matplotlib the table alone, and a
line says so). ``python bench/distill_demo.py [--steps 60] [--teacher-steps 150] [--out DIR]``
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "data.seq_len=64",
    "data.batch_size=8",
    "data.max_bytes=4000000",
    "trainer.limit_val_batches=8",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "callbacks=model_checkpoint",
    "logger=csv",
    "seed=1234",
]
TEACHER = ["model.name=teacher", "model.n_layers=4", "model.d_model=256", "model.n_heads=8", "model.ffn_hidden=704"]


def _train(args: list[str], run_dir: Path) -> tuple[dict, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "train.py", *args, *COMMON, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return json.loads((run_dir / "metrics.json").read_text()), seconds


def _val_curve(run_dir: Path) -> list[tuple[int, float]]:
    points = []
    for path in sorted(run_dir.glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("val_loss"):
                    points.append((int(row["step"]), float(row["val_loss"])))
    return sorted(set(points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--teacher-steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=15, help="validate every N steps")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/distill_demo"))
    a = parser.parse_args()
    val = [f"trainer.val_check_interval={a.every}", "trainer.check_val_every_n_epoch=null"]
    teacher_dir = a.out / "teacher"
    if not (teacher_dir / "checkpoints" / "last.ckpt").is_file():
        t_metrics, t_sec = _train(["task_name=teacher", *TEACHER, f"trainer.max_steps={a.teacher_steps}", *val],
                                  teacher_dir)  # fmt: skip
        print(f"teacher: {t_metrics['n_params']:,} params, {a.teacher_steps} steps, val_loss "
              f"{t_metrics['val_loss']:.4f}, {t_sec:.0f} s")  # fmt: skip
    student = ["model=gpt_tiny", f"trainer.max_steps={a.steps}", *val]
    alone, alone_sec = _train(student, a.out / "alone")
    distilled, distill_sec = _train(
        ["experiment=distill", f"distill.teacher={teacher_dir / 'checkpoints' / 'last.ckpt'}",
         f"distill.alpha={a.alpha}", f"distill.temperature={a.temperature}", *student],
        a.out / "distilled",
    )  # fmt: skip
    curves = {"alone": _val_curve(a.out / "alone"), "distilled": _val_curve(a.out / "distilled")}
    print(f"student: {alone['n_params']:,} params, {a.steps} steps, validation CE (val_loss) by step")
    print("| step | alone | distilled |\n|---:|---:|---:|")
    by_step = dict(curves["alone"])
    for step, value in curves["distilled"]:
        print(f"| {step} | {by_step.get(step, float('nan')):.4f} | {value:.4f} |")
    print(f"final val_loss: alone {alone['val_loss']:.4f} ({alone_sec:.0f} s), distilled {distilled['val_loss']:.4f} "
          f"({distill_sec:.0f} s; train/kl {distilled.get('train_kl')})")  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in curves.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=f"student {name}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation cross-entropy (nats/byte)")
    ax.set_title(f"gpt_tiny on stdlib_text: distilled (alpha={a.alpha}, T={a.temperature}) vs alone")
    ax.legend()
    fig.tight_layout()
    fig.savefig(ROOT / "bench" / "distill_demo.png", dpi=120)
    print(f"plot: {ROOT / 'bench' / 'distill_demo.png'}")


if __name__ == "__main__":
    main()
