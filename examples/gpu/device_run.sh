#!/bin/bash
# One bounded session on a 2-GPU host (run from the repo root, $OUT = where results go):
# recorder fidelity (Work and event completion), the four NCCL hangs through hangdoc (records,
# watchdog stacks, py-spy plain/native/locals, Flight Recorder), then the overhead benchmark.
# Every step has a timeout; the hang jobs are killed by capture.py.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,sys;print('torch',torch.__version__,'nccl',torch.cuda.nccl.version(),'python',sys.version.split()[0],'gpus',torch.cuda.device_count())"
  py-spy --version; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== fidelity $(date +%T)"
for mode in work event; do
  HANGDOC_CUDA_COMPLETION=$mode timeout 90 python3 -m torch.distributed.run --nproc-per-node 2 \
    --master-port $((29600 + RANDOM % 300)) examples/gpu/recorder_fidelity.py 2>&1 | grep -v "^\*\|OMP_NUM"
  echo "fidelity $mode rc ${PIPESTATUS[0]}"
done
echo "== captures $(date +%T)"
rm -rf /tmp/cap && mkdir -p /tmp/cap
for s in nccl_skip_broadcast nccl_dataloader_deadlock nccl_pipeline_cycle nccl_stream_misplacement; do
  timeout 170 python3 examples/gpu/capture.py --hangdoc --no-archive --out /tmp/cap \
    --hang-wait "${HANG_WAIT:-25}" --nccl-timeout 25 --fr-wait 22 $s > /tmp/cap/$s.capture.log 2>&1 &
done
wait
cat /tmp/cap/*.capture.log
tar czf "$OUT/captures.tgz" -C /tmp cap
echo "== detect $(date +%T)"
if [ -n "${DETECT_CMD:-}" ]; then
  mkdir -p /tmp/detect
  timeout 120 bash -c "$DETECT_CMD" > /tmp/detect/run.log 2>&1
  echo "detect rc $?"
  tail -40 /tmp/detect/run.log
  tar czf "$OUT/detect.tgz" -C /tmp detect
fi
echo "== recorder alone $(date +%T)"
for mode in work event; do
  HANGDOC_CUDA_COMPLETION=$mode timeout 75 python3 benchmarks/bench_recorder.py --cuda --world 2 --calls 3000 --rounds 9
  echo "bench_recorder $mode rc $?"
done
echo "== bench $(date +%T)"
timeout "${BENCH_TIMEOUT:-260}" python3 benchmarks/bench_gpu_overhead.py --repeats "${REPEATS:-3}"
echo "bench rc $?"
echo "== done $(date +%T)"
