#!/bin/bash
PY=/work/main/.venv/bin/python
OUT=/tmp/optstep_scratch/final; mkdir -p $OUT
NEW=$(cd /tmp/wt/optstep && git rev-parse --short HEAD)
echo "start $(date -u +%H:%M:%S) load $(cat /proc/loadavg)"
for r in 1 2 3; do
  for opt in adam sgd; do
  echo "== before (04ca961) $opt round $r"; (cd /tmp/optstep_scratch/base && PYTHONPATH=$PWD $PY tools/bench_optimizer_step.py --optimizer $opt --calls 200 --out $OUT/opt_before_${opt}_$r.json | tail -2)
  echo "== after ($NEW) $opt round $r"; (cd /tmp/wt/optstep && PYTHONPATH=$PWD $PY tools/bench_optimizer_step.py --optimizer $opt --calls 200 --out $OUT/opt_after_${opt}_$r.json | tail -2)
  done
  echo "== data before (04ca961) round $r"; (cd /tmp/optstep_scratch/base && PYTHONPATH=$PWD $PY tools/bench_batch_loading.py --microbatches 2000 --workdir /tmp/optstep_scratch/bb0 --out $OUT/data_before_$r.json | tail -2)
  echo "== data after ($NEW) round $r"; (cd /tmp/wt/optstep && PYTHONPATH=$PWD $PY tools/bench_batch_loading.py --microbatches 2000 --workdir /tmp/optstep_scratch/bb --out $OUT/data_after_$r.json | tail -2)
done
echo "end $(date -u +%H:%M:%S) load $(cat /proc/loadavg)"
