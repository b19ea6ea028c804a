import pytest
import torch

from lightning_trainopt.metrics.throughput import batch_size_of, throughput


def test_batch_shapes():
    assert batch_size_of(torch.zeros(4, 16)).tokens == 64
    b = batch_size_of((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16)))
    assert (b.samples, b.tokens, b.seq_len) == (4, 64, 16)
    assert batch_size_of([torch.zeros(3)]).tokens == 3
    d = batch_size_of({"input_ids": torch.zeros(2, 8), "labels": torch.zeros(2, 8)})
    assert (d.samples, d.tokens) == (2, 16)


def test_attention_mask_counts_real_tokens_on_device():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    b = batch_size_of({"input_ids": torch.zeros(2, 4), "attention_mask": mask})
    assert isinstance(b.tokens, torch.Tensor)
    assert int(b.tokens) == 5
    assert b.samples == 2
    assert b.seq_len == 4


def test_no_tensor_raises():
    with pytest.raises(TypeError, match="tokens_fn"):
        batch_size_of({"text": ["a", "b"]})


def test_rates_and_mfu_exact():
    w = throughput(
        seconds=2.0, samples=8, tokens=1024, world_size=4, model_flops=6e12, hardware_flops=8e12, peak_flops=1e12
    )
    assert w.tokens_per_s == 512
    assert w.tokens_per_s_total == 2048
    assert w.samples_per_s == 4
    assert w.samples_per_s_total == 16
    assert w.tflops_per_s == 3.0
    assert w.mfu == 3.0
    assert w.hfu == 4.0


def test_counts_of_one_replica_shared_by_its_tensor_parallel_devices():
    # 2 replicas of 2 devices: one replica's 1000 tokens and 8e12 FLOPs in 2 s.
    r = throughput(2.0, 4, 1000, world_size=4, model_flops=8 * 10**12, peak_flops=1e12, data_parallel_size=2)
    assert (r.tokens_per_s_total, r.samples_per_s_total) == (1000.0, 4.0)  # x 2 replicas, not x 4 ranks
    assert (r.tokens_per_s, r.samples_per_s) == (250.0, 1.0)  # all replicas' rate over 4 devices
    assert (r.tflops_per_s, r.mfu, r.hfu) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="data_parallel_size=3 must be a positive divisor of world_size=4"):
        throughput(2.0, 4, 1000, world_size=4, data_parallel_size=3)


def test_no_peak_means_no_mfu():
    w = throughput(1.0, 1, 10, model_flops=10)
    assert w.mfu is None
    assert w.hfu is None
    assert w.tflops_per_s == 1e-11
    with pytest.raises(ValueError, match="positive"):
        throughput(0.0, 1, 1)


def test_unknown_counts_give_no_rates():
    w = throughput(2.0, None, 100, world_size=2)
    assert w.samples_per_s is None
    assert w.samples_per_s_total is None
    assert w.tokens_per_s == 50
    assert w.tokens_per_s_total == 100
    w = throughput(2.0, 8, None)
    assert (w.tokens_per_s, w.tokens_per_s_total, w.samples_per_s) == (None, None, 4)


def test_mask_tokens_off_counts_the_padded_shape():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    b = batch_size_of({"input_ids": torch.zeros(2, 4), "attention_mask": mask}, mask_tokens=False)
    assert b.tokens == 8
