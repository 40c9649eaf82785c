#!/usr/bin/env bash
# Run HERE (a machine with PyPI), before a device run: the wheels the H200 image lacks, into .whl/
# at the repo root (ignored by git), for bench/gpu.sh to install there with no network.
#
#   bench/gpu-wheels.sh                   then the device run: carry [".whl"], command
#                                         `bench/gpu.sh $OUT/gpu-h200`
#   FLASHINFER_VERSION=none bench/gpu-wheels.sh     without FlashInfer (its columns stay empty)
#
# The H200 image (Python 3.12, torch 2.11.0+cu130, triton 3.6.0, pytest, hypothesis, numpy,
# prometheus-client, httpx, anyio, click, h11, einops, ninja, nvidia-ml-py, nvcc 13.0) lacks:
# - fastapi and its stack (starlette, pydantic, pydantic-core, annotated-types, typing-inspection,
#   opentelemetry-api), which tests/test_kernels.py imports through minigrid_engine.handle ->
#   router, and uvicorn, which its `minigrid serve` test starts; typing-extensions and anyio travel
#   too, at the versions pydantic and starlette want (the image's may be older);
# - FlashInfer, bench/kernels.py's peer: flashinfer-python (pure Python; it JIT-compiles the
#   decode kernel with the image's nvcc on first use, a minute or two) and what `import flashinfer`
#   and the decode wrapper load that the image lacks: apache-tvm-ffi, requests, urllib3, tqdm. Its other
#   needs (cutlass-dsl, cudnn-frontend, cuda-tile, nccl4py) are for other backends, loaded lazily.
#   0.6.18.post1 is the newest that fits: 0.7.x wheels are 34-101 MB, flashinfer-cubin 300+ MB,
#   and what travels to the device is limited to 64 MiB, the working tree included.
# Same versions as the .venv the CPU suite passes with. The total is checked against 50 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
dest=.whl
flashinfer="${FLASHINFER_VERSION:-0.6.18.post1}"
pins=(
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  opentelemetry-api==1.45.2
  typing-extensions==4.16.0
  anyio==4.16.0
  uvicorn==0.55.0
)
if [ "$flashinfer" != none ]; then
  # requests (with urllib3) and tqdm: `import flashinfer` imports them (artifacts.py, autotuner.py)
  pins+=("flashinfer-python==$flashinfer" "apache-tvm-ffi==0.1.15.post2" requests==2.34.2 urllib3==2.8.0 tqdm==4.70.1)
fi

rm -rf "$dest"  # one version of each name: two stop the whole install there
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$dest" "${pins[@]}"

ls -l "$dest"
bytes=$(du -cb "$dest"/*.whl | tail -n 1 | cut -f1)
echo "$(ls "$dest"/*.whl | wc -l) wheels, $((bytes / 1024 / 1024)) MiB in $dest/"
if [ "$bytes" -gt $((50 * 1024 * 1024)) ]; then
  echo "over 50 MiB: with the working tree it may pass the device's 64 MiB limit" >&2
  exit 1
fi
git check-ignore -q "$dest/" || echo "warning: $dest/ is not ignored by git (add /.whl/ to .gitignore)" >&2
