"""Time to first token of one image prompt (a 448x448 image and 64 text tokens) on a tiny
random Qwen2.5-VL, jaxserve (`LLM`, its engine core in its own process) against HF
transformers (fp32, `generate(max_new_tokens=1)` after its image processor) on the same
weights, and the image's share of each (jaxserve: the TTFT less that of a text prompt of
the same length; HF: its vision tower's time alone).

    python scripts/bench_image_ttft.py [--runs 10] [--out results.json]

Each run uses a new image (no prefix-cache or encoder-cache hit); the median is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import transformers

    from jaxserve import LLM, SamplingParams
    from jaxserve.multimodal.processing import pil_image_processor_class
    from tests.multimodal.tiny_vlm import draw_image, make_tiny_qwen2_5_vl

    work = Path(tempfile.mkdtemp())
    model_dir = make_tiny_qwen2_5_vl(work / "qwen")
    # 448x448 at patch 14: a 32x32 patch grid, 256 image tokens
    cls = pil_image_processor_class("Qwen2VLImageProcessor")
    processor = cls(min_pixels=448 * 448, max_pixels=448 * 448)
    processor.save_pretrained(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "x" * 60 + "<|vision_start|><|image_pad|><|vision_end|>"
    images = [draw_image(100 + i, 448, 448) for i in range(args.runs + 1)]

    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    image_id = hf.config.image_token_id

    def hf_ttft(image) -> tuple[float, float]:
        t0 = time.perf_counter()
        pixels = processor(images=[image], return_tensors="pt")
        n = int(pixels["image_grid_thw"][0].prod()) // 4
        ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")
        ids["mm_token_type_ids"] = (ids["input_ids"] == image_id).int()
        with torch.no_grad():
            hf.generate(**ids, **pixels, max_new_tokens=1, do_sample=False)
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        with torch.no_grad():
            hf.model.visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"])
        return total, time.perf_counter() - t1

    hf_ttft(images[-1])  # warm-up
    hf_runs = [hf_ttft(im) for im in images[: args.runs]]

    llm = LLM(str(model_dir), max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=1)

    def ours(prompt) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t0

    ours({"prompt": text, "multi_modal_data": {"image": images[-1]}})  # warm-up
    image_runs = [ours({"prompt": text, "multi_modal_data": {"image": im}}) for im in images[:-1]]
    n_prompt = len(
        llm.generate({"prompt": text, "multi_modal_data": {"image": images[0]}}, params)[
            0
        ].prompt_token_ids
    )
    text_runs = [ours({"prompt_token_ids": [i % 200 + 1] * n_prompt}) for i in range(args.runs)]

    med = statistics.median
    hf_total, hf_vision = med(r[0] for r in hf_runs), med(r[1] for r in hf_runs)
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "prompt_tokens": n_prompt,
        "image": "448x448 (256 tokens)",
        "runs": args.runs,
        "jaxserve_ttft_ms": round(med(image_runs) * 1e3, 2),
        "jaxserve_text_only_ttft_ms": round(med(text_runs) * 1e3, 2),
        "jaxserve_image_share": round(1 - med(text_runs) / med(image_runs), 3),
        "hf_ttft_ms": round(hf_total * 1e3, 2),
        "hf_vision_ms": round(hf_vision * 1e3, 2),
        "hf_image_share": round(hf_vision / hf_total, 3),
        "ttft_ratio_hf_over_jaxserve": round(hf_total / med(image_runs), 2),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
