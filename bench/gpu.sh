#!/usr/bin/env bash
# The GPU checks of the Triton kernels, as one prepared script: under 10 minutes in the worst case
# (time limits 90 + 180 + 300 s), about 4-6 minutes expected on an H200.
#
#   bench/gpu.sh RESULTS_DIR            e.g. bench/gpu.sh bench/results/gpu-h200
#   SKIP_TESTS=1 bench/gpu.sh DIR       only bench/kernels.py (it checks correctness itself)
#
# 1. tests/test_kernels.py on the GPU: the compiled kernels against the torch reference, the
#    model's greedy tokens with both backends, the leak and its owner-check  -> test_kernels.log
# 2. FlashInfer, when it is importable or pip can install it (no network: its rows are skipped)
# 3. bench/kernels.py: correctness on the device, then decode time and HBM bandwidth for batch
#    1/8/64 x context 1k/8k/32k (32 q heads, 8 kv heads, head_dim 128, fp16, page 64) against
#    torch SDPA and FlashInfer, the owner-check's overhead, engine tokens/s  -> kernels-cuda.json
#
# Every step has a time limit; kernels-cuda.json is rewritten after each section, so a run cut
# short keeps what it measured. Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu.sh RESULTS_DIR}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree, installed or not
py="${PYTHON:-python3}"
status=0

"$py" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device visible"
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)' || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv \
  > "$out/nvidia-smi.csv" 2>&1 || true

if ! "$py" -c 'import flashinfer' 2>/dev/null; then
  echo "FlashInfer: trying pip install flashinfer-python (skipped if there is no network)"
  timeout 90 "$py" -m pip install -q flashinfer-python > "$out/flashinfer-install.log" 2>&1 \
    || echo "FlashInfer: not installed (see $out/flashinfer-install.log); its columns stay empty"
fi

if [ -n "${SKIP_TESTS:-}" ]; then
  echo "SKIP_TESTS set: kernel tests skipped"
elif "$py" -c 'import pytest, hypothesis' 2>/dev/null; then
  echo "tests/test_kernels.py on the GPU"
  timeout 180 "$py" -m pytest tests/test_kernels.py -q -x -p no:cacheprovider > "$out/test_kernels.log" 2>&1 \
    || status=1
  tail -n 3 "$out/test_kernels.log"
else
  echo "pytest or hypothesis missing: kernel tests skipped (bench/kernels.py still checks correctness)"
fi

echo "bench/kernels.py"
timeout 300 "$py" bench/kernels.py --out "$out" 2>&1 | tee "$out/kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "results in $out (exit $status)"
exit "$status"
