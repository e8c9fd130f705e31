set -u
# Capture the detector's publications on a 2-GPU host (tests/fixtures/detect/gpu-queue/README.md):
#   bash examples/detect/peek/device_capture.sh OUTDIR      (from the repository root)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUTD=$1
OUT=$OUTD/m JOBS=4 MATRIX_LIMIT=300 NAME=nccl-x2 MATRIX_ARGS='--only opposite_groups_pair,pp_skip_pair,no_majority --columns injob,aggregate,detect --gpus 2' bash examples/bugs/device_matrix.sh > $OUTD/matrix-run.txt 2>&1
W=/tmp/cap; rm -rf $W /tmp/bug /tmp/ok /tmp/pp; mkdir -p $W/bug $W/ok $W/pp
for s in opposite_groups_pair:bug:29533 pp_skip_pair:pp:29535; do
  IFS=: read name d port <<< "$s"
  (BUG_BACKEND=nccl DBG_OUT=$W/$d PYTHONPATH=$PWD/examples/detect/peek:$PWD timeout 12 python3 -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port $port -m hangdoc --detect --out /tmp/$d examples/bugs/$name.py > $W/$d/log.txt 2>&1)
  cp /tmp/$d/divergence.json $W/$d/ 2>/dev/null
done
STEPS=40 DBG_OUT=$W/ok PYTHONPATH=$PWD/examples/detect/peek:$PWD timeout 150 python3 -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29534 -m hangdoc --detect --out /tmp/ok examples/detect/nccl_two_groups_ok.py > $W/ok/log.txt 2>&1
echo "ok rc=$?" >> $W/ok/log.txt
ls /tmp/ok >> $W/ok/log.txt
tar czf $OUTD/cap.tgz -C $W bug ok pp
grep "bug_matrix\|^|" $OUTD/matrix-run.txt
grep -a "DIVERGENCE" $W/*/log.txt | cut -c1-300
tail -3 $W/ok/log.txt
