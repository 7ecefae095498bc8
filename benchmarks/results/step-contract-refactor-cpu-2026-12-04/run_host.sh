#!/bin/bash
cd /work/main
for round in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then export PYTHONPATH=<checkout of b9697c8>; else export PYTHONPATH=/work/main; fi
    S=runs/$side.$round
    .venv/bin/python $PYTHONPATH/benchmarks/bench_host_step.py --rows 256 512 --iters 50 > $S.host_step 2>&1
    .venv/bin/python $PYTHONPATH/benchmarks/bench_engine_host.py --rows 256 512 > $S.engine_host 2>&1
  done
done
echo done
