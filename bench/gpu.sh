#!/usr/bin/env bash
# The GPU checks of the Triton kernels, as one prepared script: at most 560 s in all (every step
# has a time limit, each cut to what is left of that budget; the tests leave the benchmark at
# least 240 s), about 4-6 minutes expected on an H200.
#
#   bench/gpu.sh RESULTS_DIR            e.g. bench/gpu.sh bench/results/gpu-h200
#   SKIP_TESTS=1 bench/gpu.sh DIR       only bench/kernels.py (it checks correctness itself)
#
# On the lent H200 (no network; its image lacks fastapi, uvicorn, pydantic and FlashInfer):
#   here:        bench/gpu-wheels.sh    the missing wheels into .whl/ (ignored by git, ~23 MiB)
#   device run:  carry [".whl"], command `bench/gpu.sh $OUT/gpu-h200` (timeout_s 600);
#                the results come back under the device's files_at folder, gpu-h200/
#
# 0. the wheels in .whl/, when there are any: installed offline into /tmp/site, put first on
#    PYTHONPATH (for the test's `minigrid serve` subprocess too)  -> wheels-install.log
# 1. tests/test_kernels.py on the GPU: the compiled kernels against the torch reference, the
#    model's greedy tokens with both backends, the leak and its owner-check  -> test_kernels.log
# 2. FlashInfer, when it is importable (from .whl/; with no .whl/, when pip can install it within
#    90 s): its decode kernel JIT-compiles (a minute or two) in the background during step 1,
#    and step 3 waits on FlashInfer's lock if it is still building  -> flashinfer-warmup.log;
#    not importable: its columns stay empty
# 3. bench/kernels.py: correctness on the device, then decode time and HBM bandwidth for batch
#    1/8/64 x context 1k/8k/32k (32 q heads, 8 kv heads, head_dim 128, fp16, page 64) against
#    torch SDPA and FlashInfer, the owner-check's overhead, engine tokens/s  -> kernels-cuda.json
#    (peak: the chip's data sheet, H200 or H100 alike, and a device-to-device copy measured
#    first; the last lines print whether the issue's goals at batch 64 x 8k were met)
#
# Every step has a time limit; kernels-cuda.json is rewritten after each section, so a run cut
# short keeps what it measured. Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/gpu.sh RESULTS_DIR}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this tree, installed or not
py="${PYTHON:-python3}"
unset TRITON_INTERPRET  # the kernels compile for the GPU here, never through the CPU interpreter
status=0
budget=${GPU_BUDGET_S:-560}  # the device's 600 s limit, less time to send the results back
left() {  # the step's own limit ($1), or what is left of the budget, less $2 kept for later steps
  local rest=$((budget - SECONDS - ${2:-0}))
  [ "$rest" -gt 1 ] || rest=1
  echo $(( rest < $1 ? rest : $1 ))
}

timeout "$(left 60)" "$py" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device visible"
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)' || exit 2
timeout 20 nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv \
  > "$out/nvidia-smi.csv" 2>&1 || true

wheels=(.whl/*.whl)
if [ -e "${wheels[0]}" ]; then  # carried from a machine with PyPI (bench/gpu-wheels.sh)
  echo "installing ${#wheels[@]} wheels from .whl/ into /tmp/site"
  if timeout "$(left 60)" "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${wheels[@]}" > "$out/wheels-install.log" 2>&1; then
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "wheels: install failed (see $out/wheels-install.log)"
    status=1
  fi
elif ! timeout "$(left 30)" "$py" -c 'import flashinfer' 2>/dev/null; then  # no wheels: only where there is a network
  echo "FlashInfer: trying pip install flashinfer-python (fails fast without network)"
  timeout "$(left 90)" "$py" -m pip install -q --retries 0 --timeout 10 flashinfer-python \
    > "$out/flashinfer-install.log" 2>&1 || echo "FlashInfer: pip install failed"
fi

warmup=""
if timeout "$(left 30)" "$py" -c 'import flashinfer' > "$out/flashinfer-import.log" 2>&1; then
  echo "FlashInfer: its decode kernel JIT-compiles in the background meanwhile (8 build jobs)"
  MAX_JOBS=8 timeout "$(left 420)" "$py" bench/kernels.py --flashinfer-warmup --out "$out" > "$out/flashinfer-warmup.log" 2>&1 &
  warmup=$!
else
  echo "FlashInfer: not importable (see $out/flashinfer-import.log); its columns stay empty"
fi

if [ -n "${SKIP_TESTS:-}" ]; then
  echo "SKIP_TESTS set: kernel tests skipped"
elif timeout "$(left 30)" "$py" -c 'import pytest, hypothesis' 2>/dev/null; then
  # fewer random shapes (each is a compile here), and not the benchmark's CPU form nor the
  # compile-only check: step 3 runs the benchmark itself, on the real compiler
  echo "tests/test_kernels.py on the GPU"
  MINIGRID_KERNEL_EXAMPLES_SCALE=0.4 timeout "$(left 180 240)" "$py" -m pytest tests/test_kernels.py -q -x -p no:cacheprovider \
    -k "not cpu_form and not compile_for_a_gpu" > "$out/test_kernels.log" 2>&1 || status=1
  tail -n 3 "$out/test_kernels.log"
else
  echo "pytest or hypothesis missing: kernel tests skipped (bench/kernels.py still checks correctness)"
fi

echo "bench/kernels.py"
timeout "$(left 300)" "$py" bench/kernels.py --out "$out" 2>&1 | tee "$out/kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
[ -z "$warmup" ] || kill "$warmup" 2>/dev/null  # done by now, unless its build hung
echo "results in $out (exit $status)"
exit "$status"
