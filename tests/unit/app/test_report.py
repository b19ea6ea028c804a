from rich.console import Console

from lightning_trainopt.app.report import format_bytes, print_summary, summary_rows


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
    assert rows["memory_breakdown"] == "params.device 3.00 MiB, params.cpu 0 B, activations 1.00 MiB"
    # Lists stay in metrics.json; float residue prints as 0, not 1.11e-16.
    assert rows["step_time"] == "verdict communication-bound, comm_frac 0.5512, other_frac 0"


def test_print_summary_renders_a_table(tmp_path):
    console = Console(record=True, width=120)
    print_summary({"model": "gpt_tiny", "global_step": 300}, tmp_path / "metrics.json", console=console)
    text = console.export_text()
    assert "lightning_trainopt run summary" in text
    assert "optimizer steps" in text
    assert "300" in text
    assert "metrics.json" in text
