from rich.console import Console

from lightning_trainopt.callbacks._summary_table import format_bytes, print_summary, summary_rows


def test_format_bytes_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(1.5 * 2**30) == "1.50 GiB"


def test_rows_headline_first_then_callback_sections():
    metrics = {
        "val_loss": 2.7183,
        "model": "gpt_tiny",
        "tokens_per_sec": 10512.25,
        "devices": 2,  # shown through world_size, not twice
        "optimizer": {"name": "DeepSpeedCPUAdam", "lr": 6e-05},
        "memory_breakdown": {"params": {"device": 3 * 2**20, "cpu": 0}, "activations": 2**20},
        "step_time": {"verdict": "communication-bound", "comm_frac": 0.5512, "other_frac": 1.11e-16, "remedies": ["a"]},
    }
    rows = dict(summary_rows(metrics))
    assert list(rows)[:3] == ["model", "val loss", "tokens/s (all ranks)"]
    assert rows["val loss"] == "2.7183"
    assert rows["tokens/s (all ranks)"] == "10,512.2"
    assert "devices" not in rows
    assert rows["optimizer"] == "name DeepSpeedCPUAdam, lr 6e-05"  # not rounded to 0.0001
    # Curated lines: offload parts only when there are any; fractions as percentages; lists stay in metrics.json.
    assert rows["memory per rank"] == "params 3.00 MiB · activations 1.00 MiB"
    assert rows["step time"] == "communication-bound · comm 55% other 0%"


FULL = {
    "status": "ok",
    "model": "gpt_1b",
    "global_step": 100,
    "micro_batch_size": 8,
    "offload": {"optimizer": "cpu", "param": "none"},
    "peak_memory_bytes": 40 * 2**30,
    "memory_breakdown": {
        "params": {"device": 2 * 2**30, "cpu": 0, "nvme": 0},
        "grads": {"device": 2 * 2**30, "cpu": 0, "nvme": 0},
        "optimizer_states": {"device": 0, "cpu": 12 * 2**30, "nvme": 0},
        "activations": 20 * 2**30,
        "activations_weight_copies": 2**30,
        "other": 4 * 2**30,
        "peak_memory_bytes": 40 * 2**30,
        "source": "CUDA allocator peak + tensor accounting",
        "step": 1,
    },
    "activation_checkpointing": {"wrapped": 12, "candidates": 24, "every_k": 2, "recomputed_fraction": 0.48},
    "step_time": {
        "data_wait_frac": 0.4,
        "h2d_frac": 0.01,
        "forward_frac": 0.19,
        "backward_frac": 0.3,
        "optimizer_frac": 0.1,
        "other_frac": 0.0,
        "step_s": 0.5,
        "verdict": "input-bound",
        "reason": "40% of wall time waiting for data",
        "remedies": ["raise data.num_workers"],
    },
    "throughput": {
        "tokens_per_s": 9000.0,
        "tokens_per_s_total": 36000.0,
        "tflops_per_s": 120.0,
        "mfu": 0.385,
        "hfu": 0.45,
        "dtype": "bf16",
        "hardware": "h100",
        "flops_fit": {"per_token": 1.0},
    },
    "cost": {
        "dollars": 12.5,
        "device_hours": 1.5,
        "dollars_per_1b_tokens": 96.4,
        "projected_total_dollars": 250.0,
        "projected_seconds_left": 7200.0,
        "dollars_lost_idle": 5.0,
    },
    "gpu": {"enabled": True, "util_pct_mean": 61.0, "low_util_warning": True, "means": {"0": {"util": 61}}},
    "memory_snapshot": {"enabled": True, "files": [], "oom": None},
    "non_finite": {"skipped_steps": 1, "overflow_steps": 0, "last_grad_norm": 0.91},
}


def test_every_section_is_one_curated_line_and_the_table_fits_a_screen():
    rows = dict(summary_rows(FULL))
    assert rows["memory per rank"] == (
        "params 2.00 GiB · grads 2.00 GiB · optimizer 0 B (+12.00 GiB cpu) · activations 20.00 GiB "
        "(weight copies 1.00 GiB) · other 4.00 GiB · peak 40.00 GiB · at step 1"
    )
    assert rows["throughput"] == (
        "9,000.0 tokens/s per device (36,000.0 all) · 120 TFLOP/s · MFU 38% · HFU 45% · warm-up excluded"
    )
    assert rows["step time"].startswith("input-bound (40% of wall time waiting for data) · data 40% h2d 1%")
    assert (
        rows["cost"]
        == "$12.50 spent · 1.5000 device-hours · $96.40/1B tokens · projected $250.00 · 2.00 h left · $5.00 idle"
    )
    assert rows["GPU"] == "utilisation 61% · below target"
    assert rows["checkpointing"] == "12 of 24 modules (every 2)"
    assert rows["non-finite guard"] == "skipped 1 · last grad norm 0.91"
    assert "peak_memory_bytes" not in rows  # shown inside the memory line
    console = Console(record=True, width=100)
    print_summary(FULL, None, console=console)
    assert len(console.export_text().splitlines()) <= 30


def test_print_summary_renders_a_table(tmp_path):
    console = Console(record=True, width=120)
    print_summary({"model": "gpt_tiny", "global_step": 300}, tmp_path / "metrics.json", console=console)
    text = console.export_text()
    assert "lightning_trainopt run summary" in text
    assert "optimizer steps" in text
    assert "300" in text
    assert "metrics.json" in text


def _fp8_section(fp8_layers: int, not_fp8: list[dict], warning: str | None) -> dict:
    return {
        "backend": "torchao",
        "recipe": "tensorwise",
        "emulated": True,
        "fp8_layers": fp8_layers,
        "fp32_modules": 0,
        "fp8_weight_fraction": 0.5 if fp8_layers else 0.0,
        "not_fp8": not_fp8,
        "warning": warning,
        "layers": [],
    }


HEAD = {
    "cause": "output_projection",
    "layers": 1,
    "why": "output projection",
    "change": "precision.convert_lm_head=true",
}


def test_an_fp8_run_that_converted_nothing_says_so_first():
    warning = "no layer runs in FP8 (0 of 3 linear layers): 2 small (change: precision.skip_small=false); 1 head"
    rows = dict(summary_rows({"precision_layers": _fp8_section(0, [HEAD], warning)}))
    assert rows["precision layers"] == f"FP8 (torchao tensorwise, emulated): {warning}"
    rows = dict(summary_rows({"precision_layers": _fp8_section(2, [HEAD], None)}))
    assert rows["precision layers"] == (
        "FP8 (torchao tensorwise, emulated): 2 linear layers (50% of their weights) · "
        "not FP8: 1 output projection (change: precision.convert_lm_head=true)"
    )


def test_square_brackets_in_a_value_are_printed_not_read_as_markup():
    console = Console(record=True, width=120)
    print_summary({"model": "gpt_tiny", "note": "kept [precision.keep_fp32]"}, None, console=console)
    assert "kept [precision.keep_fp32]" in console.export_text()
