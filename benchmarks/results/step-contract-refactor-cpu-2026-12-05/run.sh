#!/bin/bash
cd /work/main
D=/work/main/benchmarks/results/step-contract-refactor-cpu-2026-12-05/runs
for round in 1 2 3; do
  for side in before after; do
    export PYTHONPATH=/tmp/$side
    S=$D/$side.$round
    .venv/bin/python /tmp/$side/benchmarks/bench_host_step.py --rows 256 512 --iters 50 > $S.host_step 2>&1
    .venv/bin/python /tmp/$side/benchmarks/bench_engine_host.py --rows 256 512 > $S.engine_host 2>&1
    for b in 1 32; do
      .venv/bin/python /tmp/$side/scripts/bench_latency.py --batch-size $b --input-len 32 --output-len 32 --num-iters-warmup 2 --num-iters 5 > $S.latency_b$b 2>&1
    done
    echo "$side $round $(date)"
  done
done
echo done
