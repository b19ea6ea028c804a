#!/usr/bin/env bash
# The ONE prepared script for a GPU machine (H200): every CUDA-only test and the benchmarks' GPU modes, in one short call.
# Run from the repository root: bash bench/gpu_checks.sh   (outputs under ${OUT:-/tmp/gpu_checks})
# Keep it a plain list of commands; each engineer adds their lines. `set -u` only: one failure must not hide the rest.
set -u
OUT="${OUT:-/tmp/gpu_checks}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/torch.txt"

# --- callbacks (issue 4): NVML, memory snapshots, OOM handling, allocator breakdown --------------------------------
python -m pytest -q -p no:cacheprovider -rs tests/unit/callbacks tests/unit/core/test_hardware.py -k "gpu or nvml or oom or snapshot or detect" 2>&1 | tee "$OUT/pytest_callbacks_gpu.txt"
# --- callbacks (issue 4): overhead of all monitors vs none on the 125M model, bf16 ------------------------------------
timeout 420 python bench/callback_overhead.py --device cuda --model 125m --steps 40 --warmup 10 --rounds 3 --batch-size 8 --seq-len 1024 --log-every 10 --hook-time 2>&1 | tail -8 | tee "$OUT/callback_overhead_cuda.txt"

# --- other issues: add lines below --------------------------------------------------------------------------------
# --- planner (issue 6): predicted peak vs torch.cuda.max_memory_allocated, gpt_1b bf16 with/without checkpointing --
timeout 300 python bench/planner_accuracy.py gpu 2>&1 | tee "$OUT/planner_gpu.txt"
python -m pytest -q -p no:cacheprovider -rs tests/integration/test_planner_accuracy.py -k gpu 2>&1 | tee "$OUT/pytest_planner_gpu.txt"
