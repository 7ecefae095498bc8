from pathlib import Path

from jaxserve.benchmarks.lora import write_random_adapter
from jaxserve.transformers_utils.config import read_model_config

cfg = read_model_config("/tmp/vllm-peer/smollm2-hf", "float32")
for i in range(8):
    print(write_random_adapter(Path(f"/tmp/vllm-peer/adapters/a{i}"), cfg, 16, i))
