"""Image inputs: what a prompt's images become before the engine core sees them.

`inputs.py` holds the feature a request carries to the core (`MultiModalFeature`: the
processor's arrays for one image, where its placeholder tokens sit in the prompt and its
content hash); `media.py` loads images (bytes, data URLs, http(s), local files);
`processing.py` runs a model's HF image processor and expands each image's placeholder
token; `mrope.py` computes Qwen2.5-VL's 3-axis positions. Nothing here imports JAX: the
frontend process runs it.
"""
