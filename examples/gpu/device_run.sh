#!/bin/bash
# Bounded runs on a 2-GPU host (from the repo root; $OUT = where results go). STAGES picks what runs:
#   probe     examples/detect/nccl_skip_probe.py: which skipped-broadcast pairings NCCL "completes"
#   detect    examples/detect/nccl_silent_skip.py under --detect, with the first silent pairing the
#             probe found of the broadcast-vs-all_reduce kind (else DETECT_ARGS)
#   fidelity  examples/gpu/recorder_fidelity.py: issued vs completed on NCCL, no sync added
#   recorder  benchmarks/bench_recorder.py --cuda: recorder off/on alternating in one process
#   variants  benchmarks/bench_recorder.py --cuda --variants: the recorder on in reduced forms
#             (HANGDOC_BENCH_ONLY picks some, HANGDOC_BENCH_BASELINE adds an earlier recorder.py)
#   completion benchmarks/bench_cuda_completion.py: the CUDA bookkeeping with stand-ins, this
#             checkout vs BASELINE_FILE (an earlier recorder.py), on this host's CPU
#   ddp       benchmarks/bench_ddp_hook.py --cuda: DDP step, builtin vs hangdoc's recording hook
#   captures  the four NCCL hangs through hangdoc (records, watchdog stacks, py-spy, Flight Recorder)
#   bench     benchmarks/bench_gpu_overhead.py: none / Flight Recorder / hangdoc / both
# Every step has a timeout; the hang jobs are killed by their drivers.
set -u
OUT=${OUT:-/tmp/gpu-out}
STAGES=${STAGES:-"fidelity captures recorder bench"}
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
  lscpu | grep -m1 "Model name"; py-spy --version; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
has() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }
port() { echo $((29600 + RANDOM % 300)); }

if has probe; then
  echo "== probe $(date +%T)"
  timeout "${PROBE_TIMEOUT:-200}" python3 examples/detect/nccl_skip_probe.py --out "$OUT/probe.json" ${PROBE_ARGS:-}
  echo "probe rc $?"
fi
if has detect; then
  echo "== detect $(date +%T)"
  if [ -z "${DETECT_ARGS:-}" ] && [ -f "$OUT/probe.json" ]; then
    DETECT_ARGS=$(python3 examples/detect/nccl_skip_probe.py --pick "$OUT/probe.json")
  fi
  echo "detect with: ${DETECT_ARGS:-(defaults)}"
  rm -rf /tmp/detect && mkdir -p /tmp/detect
  # DETECT_ARGS: "ENV=VALUE ... -- script args"
  envs=${DETECT_ARGS%%--*}; args=${DETECT_ARGS#*--}; [ "$envs" = "$DETECT_ARGS" ] && args=""
  env $envs timeout 120 python3 -m torch.distributed.run --nproc-per-node 2 --master-port "$(port)" \
    -m hangdoc --detect --out /tmp/detect/out examples/detect/nccl_silent_skip.py $args > /tmp/detect/log.txt 2>&1
  echo "detect rc $?"
  grep -v "^\*\|OMP_NUM" /tmp/detect/log.txt | tail -40
  tar czf "$OUT/detect.tgz" -C /tmp detect
fi
if has fidelity; then
  echo "== fidelity $(date +%T)"
  timeout 90 python3 -m torch.distributed.run --nproc-per-node 2 --master-port "$(port)" \
    examples/gpu/recorder_fidelity.py 2>&1 | grep -v "^\*\|OMP_NUM" | tee "$OUT/fidelity.log"
  echo "fidelity rc ${PIPESTATUS[0]}"
fi
if has recorder; then
  for gap in ${EVENT_GAP_MS:-1}; do
    echo "== recorder alone, HANGDOC_CUDA_EVENT_GAP_MS=$gap $(date +%T)"
    HANGDOC_CUDA_EVENT_GAP_MS=$gap timeout 90 python3 benchmarks/bench_recorder.py --cuda --world 2 --calls "${CALLS:-3000}" --rounds "${RROUNDS:-9}" 2>&1 | tee "$OUT/recorder-gap$gap.log"
    echo "bench_recorder rc ${PIPESTATUS[0]}"
  done
fi
if has variants; then
  echo "== recorder variants $(date +%T)"
  for size in ${VSIZES:-4}; do
    timeout 150 python3 benchmarks/bench_recorder.py --cuda --world 2 --calls "${CALLS:-3000}" --rounds "${VROUNDS:-11}" --variants --size "$size" 2>&1 | tee -a "$OUT/variants.log"
    echo "variants rc ${PIPESTATUS[0]}"
  done
fi
if has completion; then
  echo "== completion bookkeeping $(date +%T)"
  timeout 150 python3 benchmarks/bench_cuda_completion.py --baseline-file "${BASELINE_FILE:?BASELINE_FILE: an earlier recorder.py}" \
    --rounds "${CROUNDS:-15}" 2>&1 | tee "$OUT/completion.log"
  echo "completion rc ${PIPESTATUS[0]}"
fi
if has ddp; then
  echo "== ddp hook $(date +%T)"
  timeout 120 python3 benchmarks/bench_ddp_hook.py --cuda ${DDP_ARGS:-}
  echo "bench_ddp_hook rc $?"
fi
if has captures; then
  echo "== captures $(date +%T)"
  rm -rf /tmp/cap && mkdir -p /tmp/cap
  for s in nccl_skip_broadcast nccl_dataloader_deadlock nccl_pipeline_cycle nccl_stream_misplacement; do
    timeout 170 python3 examples/gpu/capture.py --hangdoc --no-archive --out /tmp/cap \
      --hang-wait "${HANG_WAIT:-25}" --nccl-timeout 25 --fr-wait 22 $s > /tmp/cap/$s.capture.log 2>&1 &
  done
  wait
  tar czf "$OUT/captures.tgz" -C /tmp cap
  for s in /tmp/cap/nccl_*/; do
    echo "-- $s"; python3 -m hangdoc aggregate "$s" 2>&1 | sed -n 3,4p
    python3 -m hangdoc aggregate "$s/hangdoc-out" 2>&1 | sed -n 3,8p
  done 2>&1 | tee "$OUT/captures-verdicts.log"
fi
if has bench; then
  # BENCH_PATCHES="default _IDLE_AFTER=1.0": one bench per recorder setting (see bench_gpu_overhead.py)
  # "gc": the default with a full collection before each timed loop
  for patch in ${BENCH_PATCHES:-default}; do
    echo "== bench $patch $(date +%T)"
    gc=0; [ "$patch" = gc ] && gc=1
    { [ "$patch" = default ] || [ "$patch" = gc ]; } && patch=""
    HANGDOC_BENCH_GC=$gc HANGDOC_BENCH_PATCH="$patch" timeout "${BENCH_TIMEOUT:-280}" python3 benchmarks/bench_gpu_overhead.py --repeats "${REPEATS:-2}" --rounds "${ROUNDS:-6}" 2>&1 \
      | grep -v "^\*\|OMP_NUM\|Utils.hpp\|^$" | tee -a "$OUT/bench.log"
    echo "bench rc ${PIPESTATUS[0]}"
  done
fi
echo "== done $(date +%T)"
