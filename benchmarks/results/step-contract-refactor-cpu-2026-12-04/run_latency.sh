#!/bin/bash
cd /work/main
for round in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then export PYTHONPATH=<checkout of b9697c8>; else export PYTHONPATH=/work/main; fi
    S=runs/$side.$round
    for b in 1 32; do
      .venv/bin/python $PYTHONPATH/scripts/bench_latency.py --batch-size $b --input-len 32 --output-len 32 --num-iters-warmup 2 --num-iters 5 > $S.latency_b$b 2>&1
    done
    echo "$side $round $(date)"
  done
done
echo done
