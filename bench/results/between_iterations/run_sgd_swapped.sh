#!/bin/bash
PY=/work/main/.venv/bin/python
OUT=/tmp/optstep_scratch/swap; mkdir -p $OUT
echo "start $(date -u +%H:%M:%S) load $(cat /proc/loadavg)"
for r in 1 2 3; do
  echo "== after sgd round $r"; (cd /tmp/wt/optstep && PYTHONPATH=$PWD $PY tools/bench_optimizer_step.py --optimizer sgd --calls 200 --out $OUT/after_$r.json | tail -2)
  echo "== before sgd round $r"; (cd /tmp/optstep_scratch/base && PYTHONPATH=$PWD $PY tools/bench_optimizer_step.py --optimizer sgd --calls 200 --out $OUT/before_$r.json | tail -2)
done
echo "end $(date -u +%H:%M:%S) load $(cat /proc/loadavg)"
