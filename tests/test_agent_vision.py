"""Images in tool-calling episodes: prompts with images, and tools that return images, reaching a tiny
vision-language model's next turn and its scoring (models and processors built offline)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from datasets import Dataset
from helpers import TurnScriptedGenerator, make_config
from vision_models import (
    build_qwen2_vl,
    build_qwen3_vl,
    build_smolvlm,
    image_prompt,
    logps_with_and_without_images,
    random_image,
)

from posttrain import GRPOTrainer
from posttrain.agents.loop import LoopSettings, ToolLoop
from posttrain.agents.templates import resolve_template, training_template
from posttrain.agents.tools import tool_table, tools_from_functions
from posttrain.data.chat import render_template

SCREEN_SIZES = {1: (56, 28), 2: (42, 70)}


def screenshot(page: int) -> list:
    """Take a screenshot of a page.

    Args:
        page: Which page to show.

    Returns:
        The screenshot and a caption.
    """
    return [
        {"type": "image", "image": random_image(100 + page, SCREEN_SIZES[page])},
        {"type": "text", "text": "Here."},
    ]


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


SCRIPTS = {
    "What is 0 plus one?": [call("screenshot", '{"page": 1}'), "It shows page one."],
    "What is 1 plus one?": [call("screenshot", '{"page": 2}'), "Page two."],
    "What is 2 plus one?": ["No tool needed."],
    "What is 3 plus one?": [call("screenshot", '{"page": 2}'), "Two again."],
}


class RecordingGenerator(TurnScriptedGenerator):
    """The scripted turns, recording each call's inputs (the prompt rows and the image inputs)."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, SCRIPTS)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **kwargs: Any):
        self.calls.append((prompt_ids, prompt_mask, kwargs))
        return super().generate(prompt_ids, prompt_mask, **kwargs)


def tool_processor(build) -> tuple[Any, Any]:
    """A tiny VLM whose processor and tokenizer carry posttrain's qwen tool template (it writes
    Qwen-VL's image placeholder for image blocks, in user and tool messages alike)."""
    model, processor = build()
    processor.chat_template = processor.tokenizer.chat_template = training_template("qwen")
    return model, processor


def tool_loop(processor, max_completion_length: int = 400) -> ToolLoop:
    tok = processor.tokenizer
    tools = tool_table(tools_from_functions([screenshot]))
    template = resolve_template(processor.chat_template, [t.schema for t in tools.values()])
    settings = LoopSettings(max_completion_length, None, None, [tok.eos_token_id], tok.pad_token_id)
    return ToolLoop(tok, template, settings, processor)


def image_tokens(processor, image) -> tuple[dict[str, torch.Tensor], int]:
    """The processor's image tensors for one image, and how many placeholder tokens it expands to."""
    out = processor(text=["<|image_pad|>"], images=[image], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, out[
        "input_ids"
    ].shape[1]


def run_episodes(processor, rows: list[int], prompt_images: bool):
    loop = tool_loop(processor)
    generator = RecordingGenerator(processor.tokenizer)
    prompts = [image_prompt(i, images=int(prompt_images)) for i in rows]
    images = [[random_image(i, (40, 50))] if prompt_images else [] for i in rows]
    tools = [loop_tools() for _ in rows]
    out = loop.run(generator, prompts, tools, torch.device("cpu"), images if prompt_images else None)
    return out, generator, prompts, images


def loop_tools():
    return tool_table(tools_from_functions([screenshot]))


# ---- the tool's image reaches the next turn -------------------------------------------------------


def test_a_tool_image_reaches_the_next_turn_through_the_processor():
    _, processor = tool_processor(build_qwen2_vl)
    tok = processor.tokenizer
    out, generator, _, _ = run_episodes(processor, [0, 2], prompt_images=False)
    first, second = generator.calls
    assert "model_inputs" not in first[2]  # no image yet: the text-only path
    assert second[0].shape[0] == 1  # only the row that called the tool continues
    inputs = second[2]["model_inputs"]
    expected, n_tokens = image_tokens(processor, random_image(101, SCREEN_SIZES[1]))
    assert torch.equal(inputs["pixel_values"], expected["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    pads = second[0][0] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert int(pads.sum()) == n_tokens == int(expected["image_grid_thw"].prod()) // 4 > 0
    assert torch.equal(inputs["mm_token_type_ids"][0].bool(), pads)  # the image's tokens, where they sit
    text = tok.decode(second[0][0][second[1][0].bool()])
    assert (
        "<tool_response>\n<|vision_start|><|image_pad|>" in text
        and "<|vision_end|>Here.\n</tool_response>" in text
    )
    r = out.rollout
    assert r.vision is not None and r.vision.rows[1] == {} and r.vision.completions[1] == {}
    inserted = r.completion_ids[0][(r.tool_mask[0] == 0) & r.completion_mask[0].bool()]
    assert int((inserted == tok.convert_tokens_to_ids("<|image_pad|>")).sum()) == n_tokens  # never trained
    assert out.completions[0][1]["content"][0]["type"] == "image"


def test_prompt_images_and_tool_images_reach_later_turns_in_order():
    _, processor = tool_processor(build_qwen2_vl)
    out, generator, _, images = run_episodes(processor, [0, 1, 2], prompt_images=True)
    first, second = generator.calls
    prompt_parts = [image_tokens(processor, row[0])[0] for row in images]
    assert torch.equal(
        first[2]["model_inputs"]["pixel_values"], torch.cat([p["pixel_values"] for p in prompt_parts])
    )
    # the two rows that called a tool: each one's prompt image, then its tool's image
    order = [prompt_parts[0], image_tokens(processor, random_image(101, SCREEN_SIZES[1]))[0],
             prompt_parts[1], image_tokens(processor, random_image(102, SCREEN_SIZES[2]))[0]]  # fmt: skip
    inputs = second[2]["model_inputs"]
    assert torch.equal(inputs["pixel_values"], torch.cat([p["pixel_values"] for p in order]))
    assert torch.equal(inputs["image_grid_thw"], torch.cat([p["image_grid_thw"] for p in order]))
    assert [len(row["image_grid_thw"]) for row in out.rollout.vision.rows] == [2, 2, 1]


# ---- scoring equals a plain forward over the whole episode --------------------------------------


def plain_episode_logps(
    model, processor, prompt, completion, images, tools
) -> tuple[list[int], torch.Tensor]:
    """The episode rendered whole by the template, encoded by the processor with all its images, and
    its tokens' log-probs from one plain forward: (tokens, [L - 1] log-probs of tokens 1..L-1)."""
    schemas = [t.schema for t in tools.values()]
    text = render_template(processor.chat_template, prompt + completion, schemas, False)
    enc = processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[0]
    ids = enc["input_ids"][0]
    logps = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
    return ids.tolist(), logps


@pytest.mark.parametrize("build", [build_qwen2_vl, build_qwen3_vl], ids=["qwen2_vl", "qwen3_vl"])
def test_episode_logps_equal_a_plain_forward_over_the_whole_episode_with_all_images(build):
    model, processor = tool_processor(build)
    model.eval()
    out, _, prompts, images = run_episodes(processor, [0, 1, 2], prompt_images=True)
    r = out.rollout
    ours, without_images = logps_with_and_without_images(model, r)
    for i in range(3):
        tool_images = [random_image(100 + p, SCREEN_SIZES[p]) for p in ([1], [2], [])[i]]
        ids, expected = plain_episode_logps(
            model, processor, prompts[i], out.completions[i], images[i] + tool_images, loop_tools()
        )
        P, T = int(r.prompt_mask[i].sum()), int(r.completion_mask[i].sum())
        row = r.prompt_ids[i][r.prompt_mask[i].bool()].tolist() + r.completion_ids[i][:T].tolist()
        assert ids[: P + T] == row  # the loop's tokens are the processor's for the whole episode
        torch.testing.assert_close(ours[i, :T], expected[P - 1 : P + T - 1], rtol=1e-5, atol=1e-5)
    model_tokens = r.model_token_mask.bool()
    assert not torch.allclose(without_images[model_tokens], ours[model_tokens], atol=1e-4)  # the images count


# ---- GRPO end to end ----------------------------------------------------------------------------


class FirstTurnCallsTheTool:
    """The trainer's own generator, except that a row's first turn calls ``screenshot`` (a random
    model would not); later turns are the model's own, sampled with the episode's images."""

    def __init__(self, real: Any, tokenizer: Any) -> None:
        self.real = real
        self.tokenizer = tokenizer
        self.image_inputs: list[dict[str, torch.Tensor]] = []

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None, model_inputs=None):
        text = self.tokenizer.decode(prompt_ids[0][prompt_mask[0].bool()], skip_special_tokens=False)
        if "<tool_response>" in text:
            self.image_inputs.append(model_inputs)
            return self.real.generate(prompt_ids, prompt_mask, max_new_tokens, model_inputs=model_inputs)
        reply = self.tokenizer(call("screenshot", '{"page": 2}'), add_special_tokens=False)["input_ids"]
        from posttrain.generation.base import Samples

        rows = [reply + [self.tokenizer.eos_token_id]] * prompt_ids.shape[0]
        return Samples.from_lists(rows, self.tokenizer.pad_token_id, prompt_ids.device)


def even_token_reward(completion_ids, **kwargs):
    return [float(sum(1 for t in ids if t % 2 == 0)) for ids in completion_ids]


def test_grpo_trains_two_steps_with_a_tool_that_returns_an_image(tmp_path):
    model, processor = tool_processor(build_qwen2_vl)
    before = [p.detach().clone() for p in model.parameters()]
    dataset = Dataset.from_dict(
        {"prompt": [image_prompt(i) for i in range(4)], "image": [random_image(i) for i in range(4)]}
    )
    args = make_config(tmp_path, max_steps=2, per_device_train_batch_size=4, num_generations=4, logging_steps=1,
                       max_completion_length=200, beta=0.1)  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=even_token_reward, args=args, train_dataset=dataset,
        processing_class=processor, tools=[screenshot],
    )  # fmt: skip
    generator = FirstTurnCallsTheTool(trainer.generator, processor.tokenizer)
    trainer.generator = trainer.sampler.generator = generator
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["tools/call_frequency"] == 1.0 and h["tools/failure_frequency"] == 0.0 for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    screen, _ = image_tokens(processor, random_image(102, SCREEN_SIZES[2]))
    inputs = generator.image_inputs[0]  # the model's second turn: the prompt's image, then the tool's
    assert len(inputs["image_grid_thw"]) == 8  # 4 rows x (prompt image + tool image)
    assert torch.equal(inputs["image_grid_thw"][1], screen["image_grid_thw"][0])
    n = screen["pixel_values"].shape[0]
    start = int(inputs["image_grid_thw"][0].prod())
    assert torch.equal(inputs["pixel_values"][start : start + n], screen["pixel_values"])


class SomeRowsCallTheTool:
    """First turn: even rows call ``screenshot``, odd rows answer (after the real generator ran on the
    prompts, images and all); later turns: the real generator, on the rows that continue."""

    def __init__(self, real: Any, tokenizer: Any) -> None:
        self.real, self.tokenizer = real, tokenizer

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None, model_inputs=None):
        from posttrain.generation.base import Samples

        texts = [
            self.tokenizer.decode(p[m.bool()], skip_special_tokens=False)
            for p, m in zip(prompt_ids, prompt_mask, strict=True)
        ]
        out = self.real.generate(prompt_ids, prompt_mask, max_new_tokens, model_inputs=model_inputs)
        if any("<tool_response>" in t for t in texts):
            return out
        replies = [call("screenshot", '{"page": 2}') if i % 2 == 0 else "No." for i in range(len(texts))]
        rows = [
            self.tokenizer(r, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            for r in replies
        ]
        return Samples.from_lists(rows, self.tokenizer.pad_token_id, prompt_ids.device)


@pytest.mark.parametrize("prompt_images", [True, False], ids=["prompt_images", "text_prompts"])
def test_qwen3_vl_two_prompts_two_generations_with_a_tool_image_in_some_rows_trains(tmp_path, prompt_images):
    """Qwen3-VL (interleaved M-RoPE, DeepStack), 2 prompts x 2 generations in two micro-batches of 2;
    half the rows get a tool image, the real generator continues them with it."""
    model, processor = tool_processor(build_qwen3_vl)
    prompts = [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(4)]  # no image blocks
    columns = (
        {"prompt": prompts, "image": [random_image(i) for i in range(4)]}
        if prompt_images
        else {"prompt": prompts}
    )
    args = make_config(tmp_path, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       num_generations=2, logging_steps=1, max_completion_length=200)  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=even_token_reward, args=args, train_dataset=Dataset.from_dict(columns),
        processing_class=processor, tools=[screenshot],
    )  # fmt: skip
    trainer.generator = trainer.sampler.generator = SomeRowsCallTheTool(
        trainer.generator, processor.tokenizer
    )
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert math.isfinite(log["loss"]) and log["tools/call_frequency"] == 0.5
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ---- bad inputs ---------------------------------------------------------------------------------


def test_a_text_only_model_refuses_a_tool_that_returns_an_image():
    from conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = training_template("qwen")
    tools = loop_tools()
    template = resolve_template(tok.chat_template, [t.schema for t in tools.values()])
    loop = ToolLoop(tok, template, LoopSettings(400, None, None, [tok.eos_token_id], tok.eos_token_id))
    with pytest.raises(ValueError, match=r"Tool 'screenshot' returned an image, but the model is text-only"):
        loop.run(
            TurnScriptedGenerator(tok, SCRIPTS), [image_prompt(0, images=0)], [tools], torch.device("cpu")
        )


def test_a_template_that_writes_no_image_placeholder_is_refused_naming_the_tool():
    _, processor = tool_processor(build_smolvlm)  # the qwen template writes Qwen's placeholder, not <image>
    loop = tool_loop(processor)
    generator = TurnScriptedGenerator(processor.tokenizer, SCRIPTS)
    with pytest.raises(
        ValueError, match=r"The result of tool 'screenshot' has 1 image\(s\), but .* rendered 0"
    ):
        loop.run(generator, [image_prompt(0, images=0)], [loop_tools()], torch.device("cpu"))


def test_a_tool_image_that_does_not_fit_ends_the_episode_before_it():
    _, processor = tool_processor(build_qwen2_vl)
    tok = processor.tokenizer
    first_turn = len(tok(call("screenshot", '{"page": 1}'), add_special_tokens=False)["input_ids"]) + 1
    loop = tool_loop(processor, max_completion_length=first_turn + 10)  # fewer than the image's tokens
    generator = RecordingGenerator(tok)
    out = loop.run(generator, [image_prompt(0, images=0)], [loop_tools()], torch.device("cpu"))
    assert len(generator.calls) == 1 and out.rollout.vision is None
    assert int(out.rollout.completion_mask.sum()) == first_turn and not bool(out.rollout.is_terminated[0])
    assert out.completions[0][-1]["role"] == "tool"  # the call ran; its image did not fit


def test_a_text_only_model_refuses_prompt_images_in_an_episode():
    from conftest import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = training_template("qwen")
    tools = loop_tools()
    template = resolve_template(tok.chat_template, [t.schema for t in tools.values()])
    loop = ToolLoop(tok, template, LoopSettings(400, None, None, [tok.eos_token_id], tok.eos_token_id))
    with pytest.raises(ValueError, match=r"Row 0 has images, but the model is text-only"):
        loop.run(
            TurnScriptedGenerator(tok, SCRIPTS),
            [image_prompt(0)],
            [tools],
            torch.device("cpu"),
            [[random_image(0)]],
        )


class CameraEnv:
    """An environment whose tool returns an image; it scores whether the model looked."""

    def reset(self, **kwargs) -> None:
        self.looked = 0

    def get_reward(self) -> float:
        return float(self.looked)

    def look(self, page: int) -> list:
        """Look at a page through the camera.

        Args:
            page: Which page to look at.

        Returns:
            The camera's picture.
        """
        self.looked += 1
        return [{"type": "image", "image": random_image(100 + page, SCREEN_SIZES[page])}]


def test_an_environment_episode_with_prompt_images_and_a_camera_tool_trains(tmp_path):
    model, processor = tool_processor(build_qwen2_vl)
    scripts = {f"What is {i} plus one?": [call("look", '{"page": 1}'), "Seen."] if i % 2 == 0 else ["Skip."]
               for i in range(4)}  # fmt: skip
    dataset = Dataset.from_dict(
        {"prompt": [image_prompt(i) for i in range(4)], "image": [random_image(i) for i in range(4)]}
    )
    args = make_config(tmp_path, max_steps=1, per_device_train_batch_size=4, num_generations=2, logging_steps=1,
                       max_completion_length=200)  # fmt: skip
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
        environment_factory=CameraEnv,
    )
    generator = RecordingGenerator(processor.tokenizer)
    generator.scripts = scripts
    trainer.generator = trainer.sampler.generator = generator
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    first, second = generator.calls
    looked = second[0].shape[0]  # the rows that called the tool continue
    assert math.isfinite(log["loss"]) and log["rewards/CameraEnv/mean"] == looked / 4
    assert len(first[2]["model_inputs"]["image_grid_thw"]) == 4  # each row's prompt image
    assert (
        len(second[2]["model_inputs"]["image_grid_thw"]) == 2 * looked
    )  # its prompt image, then the camera's
