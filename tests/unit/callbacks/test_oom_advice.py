from lightning_trainopt.callbacks._oom_advice import oom_advice

GIB = 2**30


def test_advice_with_numbers():
    lines = oom_advice(
        {"params": 2 * GIB, "grads": 2 * GIB, "optimizer_states": 4 * GIB, "activations": 12 * GIB, "other": 0},
        device_bytes=16 * GIB,
        n_layers=24,
        micro_batch=8,
        accumulate=1,
        world_size=1,
    )
    assert lines[0] == "the step needed at least 20.00 GiB of 16.00 GiB"
    assert lines[1].startswith(
        "activations are 60% of the peak (12.00 GiB); checkpointing every second block (12 of 24"
    )
    assert "saves about 6.00 GiB" in lines[1]
    assert any("halve the micro-batch (8 -> 4) and double accumulation (1 -> 2)" in line for line in lines)
    assert any("8-bit optimizer saves about 3.00 GiB" in line for line in lines)


def test_zero_advice_with_ranks_and_empty():
    lines = oom_advice({"optimizer_states": 8 * GIB, "peak": 10 * GIB}, world_size=4)
    assert lines == [
        "optimizer states are 8.00 GiB; sharding them over 4 ranks (ZeRO-1/FSDP) saves about 6.00 GiB per rank"
    ]
    assert "MemoryBreakdown" in oom_advice({})[0]


def test_halving_the_micro_batch_does_not_promise_the_weight_copies():
    # 12 GiB of activations of which 4 GiB are autocast weight copies: a smaller micro-batch cuts only 8 GiB's half.
    lines = oom_advice(
        {
            "params": 2 * GIB,
            "grads": 2 * GIB,
            "optimizer_states": 4 * GIB,
            "activations": 12 * GIB,
            "activations_weight_copies": 4 * GIB,
            "other": 0,
        },
        micro_batch=8,
    )
    assert any("halve the micro-batch (8 -> 4)" in line and "about 4.00 GiB less" in line for line in lines)
    assert any("checkpointing every second block" in line and "saves about 6.00 GiB" in line for line in lines)
