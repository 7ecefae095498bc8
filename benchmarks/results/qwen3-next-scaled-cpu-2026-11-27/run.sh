set -x
OV='{"num_hidden_layers": 4, "num_experts": 64, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}'
COMMON="--model qwen3-next-80b --load-format dummy --dtype float32 --input-len 32 --output-len 16 --max-model-len 256 --max-num-batched-tokens 256 --kv-cache-memory-bytes 1073741824 --max-num-seqs 32 --num-iters-warmup 1 --num-iters 2"
for b in 1 32; do
  for be in jaxserve hf; do
    PYTHONPATH=/tmp/benchclone timeout 900 /work/main/.venv/bin/python scripts/bench_latency.py $COMMON --batch-size $b --backend $be --hf-overrides "$OV" --output-json /tmp/qnb/qwen3_next_b${b}_${be}.json > /tmp/qnb/log_b${b}_${be}.txt 2>&1
  done
done
echo done > /tmp/qnb/DONE
