"""What the frontend reads of a model without importing any model code (vLLM's name):

  model_path.py      a model name or path -> the file or directory (the bundled default, presets)
  config.py          its HF config as a ModelConfig, its generation config (HF dir or GGUF)
  tokenizer.py       its tokenizer
  gguf_file.py       a GGUF file's metadata and tensors (a fast reader, parsed once per process)
  gguf_tokenizer.py  a GGUF file's tokenizer, built with `tokenizers` (no torch)

Below models/: nothing here imports model code, layers, flax or Pallas.
"""
