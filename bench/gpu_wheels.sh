#!/usr/bin/env bash
# Run HERE (a machine with pip access), before a GPU session: fetch the wheels the bare GPU image lacks into .whl/
# (git-ignored, ~5 MB). The image has torch, lightning, pytest, rich, matplotlib, nvidia-ml-py (python3 = 3.12) but
# no hydra, omegaconf or deepspeed, nor DeepSpeed's own requirements einops, msgpack, psutil, py-cpuinfo and ninja
# (`import deepspeed` needs the first three, CPU Adam's JIT build the last). bitsandbytes (~60 MB of CUDA builds) and
# torchao are left out on purpose: their tests skip and their benchmark rows say so when the package is missing. Then: device run with carry [".whl"], command `bash bench/gpu_checks.sh 1`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}" -d .whl \
    hydra-core==1.3.2 omegaconf==2.3.0 hjson annotated-types typing-inspection \
    einops msgpack psutil py-cpuinfo ninja \
    "pydantic==$(python -c 'from importlib.metadata import version; print(version("pydantic"))')" \
    "pydantic-core==$(python -c 'from importlib.metadata import version; print(version("pydantic-core"))')"
# sdist-only on PyPI: build pure-python wheels here (DeepSpeed builds no ops at install; they JIT on first use).
python -m pip wheel -q --no-deps --no-build-isolation -w .whl antlr4-python3-runtime==4.9.3 \
    "deepspeed==$(python -c 'from importlib.metadata import version; print(version("deepspeed"))')"
ls -la .whl
