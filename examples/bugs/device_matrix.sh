#!/bin/bash
# The bug matrix on NCCL (issue 22), bounded: from the repo root on a host with one GPU a rank
# (4 GPUs run every 4-rank scenario). Results (env.txt, matrix.log, $NAME.tgz) go to $OUT.
#   OUT=/tmp/out JOBS=8 MATRIX_LIMIT=480 [NAME=nccl-matrix] [MATRIX_ARGS='--only x --columns y'] bash examples/bugs/device_matrix.sh
# A py-spy wheel in .whl/ is installed first where py-spy is missing (a host without a registry).
set -u
OUT=${OUT:-/tmp/nccl-matrix-out}
mkdir -p "$OUT"
if ! command -v py-spy >/dev/null 2>&1 && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ hostname; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'nccl',torch.cuda.nccl.version(),'python',sys.version.split()[0],'gpus',torch.cuda.device_count())"
  lscpu | grep -m1 "Model name"; nproc; py-spy --version; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
NAME=${NAME:-nccl-matrix}
rm -rf "/tmp/$NAME"
timeout -s TERM "${MATRIX_LIMIT:-480}" python3 benchmarks/bug_matrix.py --backend nccl --jobs "${JOBS:-8}" \
  --out "/tmp/$NAME" ${MATRIX_ARGS:-} > "$OUT/matrix.log" 2>&1
echo "matrix rc $?"
tail -40 "$OUT/matrix.log"
tar czf "$OUT/$NAME.tgz" -C /tmp "$NAME"
ls -la "$OUT"
