"""Vision-language models through `LLM.generate` against HF transformers (fp32, the same
tiny random weights): greedy tokens equal HF `generate`'s, prompt logprobs (the log-softmax
of HF's logits) within 1e-4, with one and two images of different sizes; the same image
twice hits the prefix cache and different images never do; serving compiles nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.worker.executables import num_compilations
from tests.helpers import core_of, engines_in_process, runner_of
from tests.multimodal.tiny_vlm import (
    draw_image,
    gemma3_processor,
    gemma4_processor,
    llava_hf_processor,
    make_tiny_gemma3,
    make_tiny_gemma4,
    make_tiny_llava,
    make_tiny_qwen2_5_vl,
    make_tiny_qwen3_5,
    make_tiny_qwen3_vl,
    qwen3_5_processor,
    qwen_processor,
)

# (qwen3_5[_moe], qwen3_vl[_moe]: tests/models/test_qwen3_5_vl.py runs some of these on them)
MAKERS = {"llava": make_tiny_llava, "qwen": make_tiny_qwen2_5_vl, "gemma3": make_tiny_gemma3,
          "gemma4": make_tiny_gemma4,
          "qwen3_5": make_tiny_qwen3_5,
          "qwen3_5_moe": lambda out: make_tiny_qwen3_5(out, moe=True),
          "qwen3_vl": make_tiny_qwen3_vl,
          "qwen3_vl_moe": lambda out: make_tiny_qwen3_vl(out, moe=True)}  # fmt: skip
MARKS = {"llava": "<image>", "qwen": "<|vision_start|><|image_pad|><|vision_end|>",
         "gemma3": "<start_of_image>", "gemma4": "<|image|>",
         "qwen3_5": "<|vision_start|><|image_pad|><|vision_end|>",
         "qwen3_5_moe": "<|vision_start|><|image_pad|><|vision_end|>",
         "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
         "qwen3_vl_moe": "<|vision_start|><|image_pad|><|vision_end|>"}  # fmt: skip
HF_CLASSES = {"llava": "LlavaForConditionalGeneration",
              "qwen": "Qwen2_5_VLForConditionalGeneration",
              "gemma3": "Gemma3ForConditionalGeneration",
              "gemma4": "Gemma4ForConditionalGeneration",
              "qwen3_5": "Qwen3_5ForConditionalGeneration",
              "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
              "qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}  # fmt: skip

ENGINE = dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
              num_gpu_blocks_override=96, block_size=16)  # fmt: skip


class Family:
    """One architecture: its tiny model, its HF reference inputs and its prompts."""

    def __init__(self, name: str, tmp_path_factory):
        import transformers

        self.name = name
        path = tmp_path_factory.mktemp(name)
        self.dir = MAKERS[name](path)
        cls = getattr(transformers, HF_CLASSES[name])
        self.hf = cls.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.dir)
        mark = MARKS[name]
        self.prompts = [f"USER: {mark}\nWhat is it? ASSISTANT:",
                        f"USER: {mark} and {mark} differ? ASSISTANT:"]  # fmt: skip

    def hf_inputs(self, text: str, images: list) -> dict:
        """HF's model inputs: LlavaProcessor's (the reference expansion), Gemma3Processor's
        expansion and token types, or for Qwen2.5-VL
        (whose processor needs torchvision for videos) the image processor's pixels, the
        text with each image_pad repeated grid.prod() / 4 times and the token types its
        processor gives (without them HF's M-RoPE positions are plain 1-D ones)."""
        if self.name == "llava":
            return dict(llava_hf_processor(self.dir)(text=text, images=images, return_tensors="pt"))
        if self.name == "gemma3":  # Gemma3Processor's expansion and token types (its
            # constructor wants Gemma's own tokenizer attributes)
            n = self.hf.config.mm_tokens_per_image
            seq = "\n\n<start_of_image>" + "<image_soft_token>" * n + "<end_of_image>\n\n"
            ids = self.tokenizer(text.replace("<start_of_image>", seq), return_tensors="pt")
            ids["token_type_ids"] = (ids["input_ids"] == self.hf.config.image_token_index).int()
            pixels = gemma3_processor(self.dir)(images=images, return_tensors="pt")
            return {**ids, "pixel_values": pixels["pixel_values"]}
        if self.name == "gemma4":  # Gemma4Processor's expansion: <|image> n tokens <image|>
            pixels = gemma4_processor(self.dir)(images=images, return_tensors="pt")
            head, *rest = text.split("<|image|>")
            counts = pixels.pop("num_soft_tokens_per_image")
            soft = ["<|image>" + "<|image|>" * int(n) + "<image|>" for n in counts]
            text = head + "".join(s + part for s, part in zip(soft, rest, strict=True))
            ids = self.tokenizer(text, return_tensors="pt")
            ids["mm_token_type_ids"] = (ids["input_ids"] == self.hf.config.image_token_id).int()
            return {**ids, **pixels}
        processor = qwen_processor if self.name == "qwen" else qwen3_5_processor
        pixels = processor(self.dir)(images=images, return_tensors="pt")
        counts = [int(g.prod()) // 4 for g in pixels["image_grid_thw"]]
        head, *rest = text.split("<|image_pad|>")
        pads = ["<|image_pad|>" * n for n in counts]
        text = head + "".join(pad + part for pad, part in zip(pads, rest, strict=True))
        ids = self.tokenizer(text, return_tensors="pt")
        ids["mm_token_type_ids"] = (ids["input_ids"] == self.hf.config.image_token_id).int()
        return {**ids, **pixels}


@pytest.fixture(scope="module", params=["llava", "qwen", "gemma3"])
def family(request, tmp_path_factory):
    fam = Family(request.param, tmp_path_factory)
    with engines_in_process():
        fam.llm = LLM(str(fam.dir), **ENGINE)
        yield fam


IMAGES = [[draw_image(1)], [draw_image(2, 50, 90), draw_image(3, 120, 70)]]


def test_greedy_tokens_and_logprobs_equal_hf(family):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}}
               for p, ims in zip(family.prompts, IMAGES, strict=True)]  # fmt: skip
    compiled = num_compilations()
    outs = family.llm.generate(prompts, params, use_tqdm=False)
    assert num_compilations() == compiled  # every image shape was compiled at start-up
    for text, images, out in zip(family.prompts, IMAGES, outs, strict=True):
        inputs = family.hf_inputs(text, images)
        ids = inputs["input_ids"][0].tolist()
        assert out.prompt_token_ids == ids  # the placeholders expanded as HF's processor does
        with torch.no_grad():
            logits = family.hf(**inputs).logits[0].float()
            gen = family.hf.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == gen[0, len(ids) :].tolist()
        want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), ids[1:]].numpy()
        got = [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_chat_with_image_parts_equals_hf_generate_on_the_rendered_template(family):
    """LLM.chat with vLLM's image parts (a data URL and a PIL image): the family's chat
    template renders them (chat_media, the server's renderer too), and the greedy tokens and
    the prompt equal HF's on that rendering. (The same through `jaxserve serve`, one family:
    tests/entrypoints/openai/test_vlm_server.py.)"""
    import io

    from PIL import Image

    from tests.multimodal.test_media import data_url

    buf = io.BytesIO()
    draw_image(11, 70, 50).save(buf, format="PNG")
    first, second = Image.open(io.BytesIO(buf.getvalue())), draw_image(12, 40, 90)
    content = [
        {"type": "text", "text": "USER: "},
        {"type": "image_url", "image_url": {"url": data_url(buf.getvalue())}},
        {"type": "text", "text": " and "},
        {"type": "image_pil", "image_pil": second},
        {"type": "text", "text": " differ? ASSISTANT:"},
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = family.llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    template = [{"type": "image"} if p["type"] != "text" else p for p in content]
    text = family.tokenizer.apply_chat_template(
        [{"role": "user", "content": template}], tokenize=False, add_generation_prompt=True
    )
    inputs = family.hf_inputs(text, [first, second])
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        gen = family.hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.outputs[0].token_ids == gen[0, inputs["input_ids"].shape[1] :].tolist()


def test_same_image_hits_the_prefix_cache(family):
    """The same text + image again: its blocks (the image's included) come from the cache;
    the same text with another image: only the blocks before the image match."""
    params = SamplingParams(temperature=0, max_tokens=1)
    text = "x" * 40 + family.prompts[0]  # the image starts past the first two blocks
    first = family.llm.generate(
        {"prompt": text, "multi_modal_data": {"image": draw_image(7)}}, params, use_tqdm=False
    )[0]
    again = family.llm.generate(
        {"prompt": text, "multi_modal_data": {"image": draw_image(7)}}, params, use_tqdm=False
    )[0]
    other = family.llm.generate(
        {"prompt": text, "multi_modal_data": {"image": draw_image(8)}}, params, use_tqdm=False
    )[0]
    image_start = first.prompt_token_ids.index(family.hf.config.image_token_id)
    full_blocks = (len(first.prompt_token_ids) - 1) // 16 * 16
    assert again.num_cached_tokens == full_blocks > image_start
    assert other.num_cached_tokens == image_start // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_image_requests_fail_alone(family):
    """A placeholder count that does not match the images, and a non-dict multi_modal_data:
    ValueErrors naming the problem; the engine serves the next request."""
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=r"1 image placeholder\(s\).*2 image\(s\)"):
        family.llm.generate(
            {"prompt": family.prompts[0], "multi_modal_data": {"image": IMAGES[1]}}, params
        )
    with pytest.raises(ValueError, match="unsupported modality 'audio'"):
        family.llm.generate({"prompt": "hi", "multi_modal_data": {"audio": [1]}}, params)
    out = family.llm.generate("hello", params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


def test_structured_output_with_an_image(family):
    """A constrained request with an image prompt keeps to its grammar."""
    from jaxserve.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        temperature=0, max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["cat", "dog", "bird"]),
    )  # fmt: skip
    prompt = {"prompt": family.prompts[0], "multi_modal_data": {"image": draw_image(5)}}
    out = family.llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].text in ("cat", "dog", "bird")


def test_preempted_image_requests_recompute_their_images(tmp_path_factory):
    """Qwen2.5-VL (M-RoPE) with too few KV blocks for its requests at once: requests are
    preempted, recompute (their images encoded again) and give the tokens they give alone."""
    fam = Family("qwen", tmp_path_factory)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt": fam.prompts[0], "multi_modal_data": {"image": draw_image(20 + i)}}
               for i in range(4)]  # fmt: skip
    with engines_in_process():
        alone = LLM(str(fam.dir), **ENGINE)
        want = [alone.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        del alone
        tight = LLM(str(fam.dir), **{**ENGINE, "num_gpu_blocks_override": 12})
        outs = tight.generate(prompts, params, use_tqdm=False)
        core = core_of(tight)
        assert core.scheduler.total_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == want


def test_mm_processor_kwargs_reach_the_image_processor(family):
    """Options of the model's image processor per prompt (Qwen2.5-VL's max_pixels: a smaller
    image grid, fewer tokens; one past the largest encoder shape, which the processor's own
    max_pixels sets, fails that request alone, naming max_pixels); an option the processor
    does not take is a ValueError naming it."""
    params = SamplingParams(temperature=0, max_tokens=1)
    image = draw_image(9, 300, 300)
    prompt = {"prompt": family.prompts[0], "multi_modal_data": {"image": image}}
    with pytest.raises(ValueError, match="cannot process the image: .*bogus"):
        family.llm.generate({**prompt, "mm_processor_kwargs": {"bogus": 1}}, params)
    if family.name != "qwen":
        return
    sized = [{**prompt, "mm_processor_kwargs": {"max_pixels": 28 * 28 * n}} for n in (4, 64)]
    default, small, large = family.llm.generate([prompt, *sized], params, use_tqdm=False)
    image_id = family.hf.config.image_token_id
    counts = [o.prompt_token_ids.count(image_id) for o in (small, default)]
    assert counts[0] <= 4 < counts[1] <= 16  # max_pixels 4 tokens; the processor's 16
    assert large.outputs[0].finish_reason == "error"
    assert "max_pixels" in str(large.outputs[0].stop_reason)


def test_tensor_parallel_2_gives_the_tokens_of_tp_1(family):
    """tp 2: the vision tower split by heads and MLP units as the language model is (the
    first layer's fused qkv by columns), the same greedy tokens with two images."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt": family.prompts[1], "multi_modal_data": {"image": IMAGES[1]}}
    want = family.llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with engines_in_process():
        tp2 = LLM(str(family.dir), **ENGINE, tensor_parallel_size=2)
        got = tp2.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        vision = runner_of(tp2).model.vision
        layer = vision.blocks[0].attn.qkv if family.name == "qwen" else (
            vision.vision_tower.layers[0].self_attn.qkv_proj
        )  # fmt: skip
        assert tuple(layer.kernel[...].sharding.spec) == (None, "tp")
    assert got == want
