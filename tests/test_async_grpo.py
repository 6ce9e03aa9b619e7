"""Asynchronous GRPO: the score-centred gradient and the clipped objective worked by hand, the
chunked log-probs of several tokens per position, the config's contract, and the trainer end to
end: generation proven to overlap training (a rendezvous), the staleness exact, exact resume.

The score-centring formula is the paper index's ("Score Centering Stabilizes Off-policy RL"):
``grad L = -E_{o~mu}[ A (f(r_t) grad log pi(o_t) - E_{v~mu}[f(r_v) grad log pi(v)]) ]`` with
``f(r) = r`` inside ``[C_min, C_max]`` and 0 outside.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, standard_dataset, two_processes_against_one
from test_a2po import PromptKeyedGenerator
from test_invariance import SCRIPT, token_sum_reward

from posttrain import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig
from posttrain.async_grpo import losses
from posttrain.ops import chunked
from posttrain.ops.reductions import Normalizers


def async_config(tmp_path, **overrides) -> AsyncGRPOConfig:
    values = {
        "output_dir": str(tmp_path),
        **CPU_TEST_ARGS,
        "num_generations": 4,
        "max_completion_length": 8,
        "num_sampler_logprobs": 3,
        "max_staleness": 1,
    }
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def async_trainer(tmp_path, generator=PromptKeyedGenerator, dataset=None, **overrides) -> AsyncGRPOTrainer:
    tok = build_tiny_tokenizer()
    trainer = AsyncGRPOTrainer(
        build_tiny_model(tok, seed=3),
        token_sum_reward,
        async_config(tmp_path, **overrides),
        dataset if dataset is not None else standard_dataset(),
        processing_class=tok,
    )
    if generator is not None:
        trainer.generator = generator()
    return trainer


# ---- the formulas ------------------------------------------------------------------------------

F64 = torch.float64


def _f(r: float, lo: float, hi: float) -> float:
    return r if lo <= r <= hi else 0.0


def _two_token_gradient(
    o: int, z: torch.Tensor, q: torch.Tensor, adv: float, lo: float, hi: float
) -> torch.Tensor:
    """The gradient of score_centred_loss wrt the logits, the sampler's top-1 token being 0."""
    z = z.clone().requires_grad_(True)
    logp = torch.log_softmax(z, dim=-1)
    loss, _ = losses.score_centred_loss(
        logp[o].view(1, 1), logp[0].view(1, 1, 1), q.log()[o].view(1, 1), q.log()[0].view(1, 1, 1),
        torch.tensor([adv], dtype=F64), torch.ones(1, 1, dtype=F64), lo, hi, Normalizers(tokens=1.0),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, z)
    return grad


@pytest.mark.parametrize(("lo", "hi"), [(0.5, 5.0), (0.5, 1.1)], ids=["both_inside", "token_1_masked"])
def test_score_centred_gradient_on_two_tokens_by_hand(lo, hi) -> None:
    """Vocabulary {0, 1}, logits (0.3, -0.4): pi = (0.668, 0.332); the sampler mu = (0.55, 0.45)
    reports its top token 0, so the tail is token 1 and the rescaled-policy model of it is exact.
    grad_z log pi(v) = e_v - pi; the formula's inner expectation is sum_v mu(v) f(r_v) (e_v - pi)."""
    z = torch.tensor([0.3, -0.4], dtype=F64)
    q = torch.tensor([0.55, 0.45], dtype=F64)
    pi = torch.softmax(z, dim=-1)
    eye = torch.eye(2, dtype=F64)
    inner = sum(q[v] * _f((pi[v] / q[v]).item(), lo, hi) * (eye[v] - pi) for v in range(2))
    for o in range(2):
        expected = -1.5 * (_f((pi[o] / q[o]).item(), lo, hi) * (eye[o] - pi) - inner)
        torch.testing.assert_close(_two_token_gradient(o, z, q, 1.5, lo, hi), expected)
    if hi == 1.1:  # r_1 = 0.332 / 0.45 = 0.74 is inside, r_0 = 1.21 is not: token 0 carries no weight
        assert (pi[0] / q[0]).item() > 1.1


def test_a_constant_advantage_leaves_the_policy_unmoved_in_expectation() -> None:
    """sum_o mu(o) grad L(o) = 0 for a constant advantage: two tokens (K = 1, the tail exact), and
    five tokens with K = 2 where the sampler's tail is the policy's, rescaled (as modelled)."""
    z2, q2 = torch.tensor([0.3, -0.4], dtype=F64), torch.tensor([0.55, 0.45], dtype=F64)
    mean = sum(q2[o] * _two_token_gradient(o, z2, q2, 2.0, 0.5, 5.0) for o in range(2))
    torch.testing.assert_close(mean, torch.zeros(2, dtype=F64), atol=1e-12, rtol=0)

    z = torch.tensor([1.0, 0.5, -0.2, 0.1, -1.0], dtype=F64)
    pi = torch.softmax(z, dim=-1)
    head = torch.tensor([0, 1])
    q = pi.clone()
    q[head] = torch.tensor([0.5, 0.3], dtype=F64)
    q[2:] = pi[2:] * (1 - 0.8) / pi[2:].sum()  # the tail: the policy rescaled to the remaining mass
    total = torch.zeros(5, dtype=F64)
    for o in range(5):
        zz = z.clone().requires_grad_(True)
        logp = torch.log_softmax(zz, dim=-1)
        loss, _ = losses.score_centred_loss(
            logp[o].view(1, 1), logp[head].view(1, 1, 2), q.log()[o].view(1, 1), q.log()[head].view(1, 1, 2),
            torch.tensor([1.0], dtype=F64), torch.ones(1, 1, dtype=F64), 0.1, 10.0, Normalizers(tokens=1.0),
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, zz)
        total += q[o] * grad
    torch.testing.assert_close(total, torch.zeros(5, dtype=F64), atol=1e-12, rtol=0)


def test_masked_clipped_loss_by_hand() -> None:
    """A = 1 and ratios e^0.5 = 1.65 (clipped at 1.2), e^-0.1 = 0.905 (min(0.905, 0.905): unclipped),
    e^1.8 = 6.05 (outside [0.5, 5]: masked, and not counted as clipped); divided by 4 tokens."""
    logps = torch.tensor([[0.5, -0.1, 1.8]], dtype=F64, requires_grad=True)
    sampler = torch.zeros(1, 3, dtype=F64)
    adv = torch.tensor([1.0], dtype=F64)
    loss, stats = losses.masked_clipped_loss(
        logps, sampler, adv, torch.ones(1, 3, dtype=F64), 0.2, 0.2, 0.5, 5.0, Normalizers(tokens=4.0)
    )
    import math

    torch.testing.assert_close(loss, torch.tensor((-1.2 - math.exp(-0.1)) / 4, dtype=F64))
    assert stats["masked"].tolist() == [[False, False, True]]
    assert stats["high"].tolist() == [[True, False, False]]


def test_group_advantages_use_the_population_std() -> None:
    r = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=F64)
    torch.testing.assert_close(
        losses.group_advantages(r, 2), torch.tensor([-1 / (1 + 1e-8), 1 / (1 + 1e-8), 0.0, 0.0], dtype=F64)
    )


def test_chunked_log_probs_of_several_tokens_match_autograd() -> None:
    """token_stats with [N, M] targets gives log_softmax's values and gradients (float64), any chunking."""
    torch.manual_seed(0)
    h = torch.randn(5, 4, dtype=F64, requires_grad=True)
    w = torch.randn(7, 4, dtype=F64, requires_grad=True)
    targets = torch.randint(0, 7, (5, 3))
    coef = torch.randn(5, 3, dtype=F64)
    logps, _ = chunked.token_stats(h, w, None, targets, 0.7, chunk_size=2)
    (coef * logps).sum().backward()
    got = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    naive = torch.log_softmax(h @ w.t() / 0.7, dim=-1).gather(1, targets)
    torch.testing.assert_close(logps, naive)
    (coef * naive).sum().backward()
    torch.testing.assert_close(got[0], h.grad)
    torch.testing.assert_close(got[1], w.grad)


# ---- the config ----------------------------------------------------------------------------------

# The reference's AsyncGRPOConfig own fields (../shared/reference/sft-online-distillation-api.md),
# with the spec's score-centering options (paper index, "Score Centering")
REFERENCE_FIELDS = {
    "model_init_kwargs": None, "dtype": "float32", "trust_remote_code": False, "router_aux_loss_coef": None,
    "num_generations": 8, "max_completion_length": 2048, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "repetition_penalty": 1.0, "chat_template_kwargs": None, "max_tool_calling_iterations": None,
    "fork_threshold_tokens": 1024, "vllm_server_base_url": "http://localhost:8000", "vllm_server_timeout": 240.0,
    "request_timeout": 600, "weight_sync_timeout": 1800, "epsilon": 0.2, "epsilon_high": None,
    "token_budget": None, "max_inflight_tasks": -1, "max_staleness": 4, "queue_maxsize": 1024,
    "weight_sync_steps": 1, "heartbeat_stale_after_s": 300, "log_completions": False,
    "num_completions_to_print": None, "learning_rate": 1e-6, "lr_scheduler_type": "constant",
    "logging_steps": 1, "ignore_data_skip": True, "score_centering": True, "num_sampler_logprobs": 8,
    "vllm_importance_sampling_clip_min": 0.5, "vllm_importance_sampling_clip_max": 5.0,
}  # fmt: skip


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    for name, value in REFERENCE_FIELDS.items():
        assert name in defaults, f"AsyncGRPOConfig lacks the reference field {name}"
        assert defaults[name] == value, f"{name}: {defaults[name]!r} != the reference's {value!r}"
        doc = AsyncGRPOConfig.__doc__
        assert f"`{name}`" in doc or f"{name} (`" in doc or f"{name}," in doc, f"{name} undocumented"
    config = AsyncGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert config.model_init_kwargs == {"dtype": "float32"}  # dtype reaches the loader


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        pytest.param({"max_staleness": -1}, ValueError, "max_staleness=-1 is invalid", id="staleness_below_0"),
        pytest.param({"num_sampler_logprobs": 0}, ValueError, "num_sampler_logprobs=0 is invalid", id="logprobs"),
        pytest.param(
            {"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.5},
            ValueError, "must be below", id="bounds",
        ),
        pytest.param({"beta": 0.1}, ValueError, "beta=0.1 does not apply to asynchronous GRPO", id="beta"),
        pytest.param({"steps_per_generation": 2}, ValueError, "one generation batch per optimizer step", id="spg"),
        pytest.param({"weight_sync_steps": 2}, NotImplementedError, "weight_sync_steps=2", id="weight_sync_steps"),
        pytest.param({"queue_maxsize": 64}, NotImplementedError, "queue_maxsize=64", id="queue_maxsize"),
        pytest.param({"dtype": "float8"}, ValueError, "dtype='float8' is invalid", id="dtype"),
    ],
)  # fmt: skip
def test_config_rejects_bad_values(tmp_path, overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        async_config(tmp_path, **overrides)


def test_trainer_refuses_a_rollout_func_and_other_configs(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    with pytest.raises(TypeError, match="AsyncGRPOConfig"):
        AsyncGRPOTrainer(
            build_tiny_model(tok), token_sum_reward, args, standard_dataset(), processing_class=tok
        )
    with pytest.raises(NotImplementedError, match=r"AsyncGRPOTrainer\(rollout_func=...\) is not built"):
        AsyncGRPOTrainer(
            build_tiny_model(tok), token_sum_reward, async_config(tmp_path), standard_dataset(),
            processing_class=tok, rollout_func=lambda prompts, trainer: {},
        )  # fmt: skip


def test_tools_and_environments_run_in_the_background_sampler(tmp_path) -> None:
    """The environment episodes of tests/test_agent_loop.py, sampled by the background thread with
    its own environments: the same tool metrics and environment rewards as GRPOTrainer logs there,
    and the tool results' tokens kept out of the loss."""
    from helpers import TurnScriptedGenerator
    from test_agent_loop import SCRIPTS, IncrementEnv, long_context_model, qwen_tokenizer, task_dataset

    tok = qwen_tokenizer()
    environments_seen = []

    def env_state(completions, environments, **kwargs):
        environments_seen.append(environments)
        return [0.0] * len(completions)

    args = async_config(
        tmp_path, per_device_train_batch_size=8, num_generations=2, max_steps=1, max_completion_length=200,
        max_staleness=0,
    )  # fmt: skip
    trainer = AsyncGRPOTrainer(
        long_context_model(tok), env_state, args, task_dataset(), processing_class=tok,
        environment_factory=IncrementEnv,
    )  # fmt: skip
    trainer.generator = TurnScriptedGenerator(tok, SCRIPTS)
    made, build = [], trainer._background_agent
    trainer._background_agent = lambda: made.append(build()) or made[-1]
    batches = []
    take = trainer._take_batch
    trainer._take_batch = lambda step: batches.append(take(step)) or batches[-1]
    trainer.train()
    logs = next(entry for entry in trainer.state.log_history if "tools/call_frequency" in entry)
    assert logs["tools/call_frequency"] == pytest.approx(6 / 8)
    assert logs["tools/failure_frequency"] == pytest.approx(4 / 6)
    assert logs["rewards/IncrementEnv/mean"] == pytest.approx(2 / 8)
    assert made and made[0] is not None and made[0] is not trainer.agent  # the thread's own tool loop
    assert len(environments_seen[0]) == 8 and all(isinstance(e, IncrementEnv) for e in environments_seen[0])
    rollouts = [scored.rollout for scored in batches[0]]
    assert sum(int((r.completion_mask.bool() & ~r.model_token_mask.bool()).sum()) for r in rollouts) > 0
    assert all(
        torch.equal(trainer._loss_mask(r), r.model_token_mask) for r in rollouts
    )  # results not trained on


# ---- the trainer ---------------------------------------------------------------------------------


class RendezvousGenerator(PromptKeyedGenerator):
    """Generating batch 1 waits at a barrier that the training step on batch 0 also reaches: both
    pass only if they run at the same time (a rendezvous, not a timing bound)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier, self.calls = barrier, 0

    def generate(self, prompt_ids, prompt_mask, **kwargs):
        self.calls += 1
        if self.calls == 2:  # batch 1
            self.barrier.wait()
        return super().generate(prompt_ids, prompt_mask, **kwargs)


def _with_barrier_in_first_loss(trainer, barrier):
    original = trainer.compute_loss
    seen = []

    def compute_loss(model, inputs, *args, **kwargs):
        if not seen and model.training:
            seen.append(True)
            barrier.wait()  # step 0 trains here while the sampler generates batch 1
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss


def test_generation_overlaps_training(tmp_path) -> None:
    barrier = threading.Barrier(2, timeout=60)
    trainer = async_trainer(tmp_path, generator=None, max_staleness=1, max_steps=3)
    trainer.generator = RendezvousGenerator(barrier)
    _with_barrier_in_first_loss(trainer, barrier)
    trainer.train()
    assert not barrier.broken and trainer.state.global_step == 3


def test_without_staleness_there_is_no_overlap(tmp_path) -> None:
    """max_staleness=0: batch 1 needs step 0's result, so the rendezvous cannot happen."""
    barrier = threading.Barrier(2, timeout=3)
    trainer = async_trainer(tmp_path, generator=None, max_staleness=0, max_steps=2)
    trainer.generator = RendezvousGenerator(barrier)
    _with_barrier_in_first_loss(trainer, barrier)
    with pytest.raises((threading.BrokenBarrierError, RuntimeError)):
        trainer.train()
    assert barrier.broken


@pytest.mark.parametrize("staleness", [0, 2])
def test_each_batch_is_sampled_with_the_weights_of_step_k_minus_staleness(tmp_path, staleness) -> None:
    trainer = async_trainer(tmp_path, max_staleness=staleness, max_steps=5)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["batch/sampler_version"] for h in logs] == [float(max(0, k - staleness)) for k in range(5)]
    assert max(h["batch/staleness"] for h in logs) == staleness
    assert trainer.generator.rows == 5 * 4  # five batches of 4 completions: none made past max_steps


def test_trainer_feeds_its_batch_to_the_formulas(tmp_path) -> None:
    """The loss of a stale batch is score_centred_loss of the policy's log-probs at the sampled and
    the sampler's top tokens, against the sampler's own, with the batch's group advantages."""
    from posttrain.ops.logprobs import completion_logps

    trainer = async_trainer(tmp_path, max_staleness=2, per_device_train_batch_size=8)
    trainer._start_background(0)
    (chunk,) = trainer._take_batch(0)
    trainer._stop_background()
    with torch.no_grad():  # the policy moves on after the sampler's copy was taken
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    r = chunk.rollout
    out = completion_logps(
        trainer.model,
        r.prompt_ids,
        r.prompt_mask,
        r.completion_ids,
        r.completion_mask,
        extra_ids=chunk.sampler_top_ids,
    )
    mask = r.completion_mask.float()
    assert ((out.logps - chunk.sampler_logps) * mask).abs().max() > 1e-3  # a stale batch: pi != mu
    adv = losses.group_advantages(chunk.rewards[:, 0].float(), 4)
    torch.testing.assert_close(chunk.advantages, adv.to(chunk.advantages.dtype))
    expected, _ = losses.score_centred_loss(
        out.logps, out.extra_logps, chunk.sampler_logps, chunk.sampler_top_logps, adv, mask, 0.5, 5.0,
        Normalizers(tokens=mask.sum().item()),
    )  # fmt: skip
    torch.testing.assert_close(trainer.compute_loss(trainer.model, chunk), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("centering", [True, False])
def test_trains_and_logs_the_metrics(tmp_path, centering) -> None:
    trainer = async_trainer(tmp_path, generator=None, score_centering=centering, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    names = ["reward", "reward_std", "frac_reward_zero_std", "entropy", "kl", "batch/staleness",
             "batch/sampler_version", "sampling/importance_sampling_ratio/mean", "sampling/masked_ratio",
             "completions/mean_length", "num_tokens"]  # fmt: skip
    if not centering:
        names += ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    for name in names:
        assert name in logs[-1], f"{name} not logged"
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # batch 0: the sampler is the policy
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert trainer.background is None  # stopped with the training


# ---- the Keep Sampling Mask: top-k / top-p / min-p ---------------------------------------------------

TRUNCATIONS = {
    "top_k": {"top_k": 3},
    "top_p": {"top_p": 0.5},
    "min_p": {"min_p": 0.6},
    "all": {"top_k": 20, "top_p": 0.8, "min_p": 0.3},
}


@pytest.mark.parametrize("settings", TRUNCATIONS.values(), ids=TRUNCATIONS.keys())
def test_truncated_topk_is_the_softmax_restricted_to_the_support(settings) -> None:
    from posttrain.ops import support

    torch.manual_seed(1)
    scores = torch.randn(6, 40, dtype=F64) * 2
    targets = torch.randint(0, 40, (6,))
    trunc = support.Truncation(**settings)
    logps, top_logps, top_ids, ids = support.truncated_topk(scores, targets, 4, trunc)
    probs = torch.softmax(scores, dim=-1)
    for i in range(6):  # the support by its definition, filter after filter, the drawn token added
        keep = torch.ones(40, dtype=torch.bool)
        if trunc.top_k:
            keep &= scores[i] >= scores[i].topk(trunc.top_k).values[-1]
        if trunc.top_p < 1:
            order = scores[i].masked_fill(~keep, -torch.inf).argsort(descending=True)
            p = torch.softmax(scores[i].masked_fill(~keep, -torch.inf), dim=-1)[order]
            needed = int((p.cumsum(0) < trunc.top_p).sum()) + 1  # the smallest head that reaches top_p
            keep = torch.zeros(40, dtype=torch.bool).index_fill(0, order[:needed], True)
        if trunc.min_p:
            p = torch.softmax(scores[i].masked_fill(~keep, -torch.inf), dim=-1)
            keep &= p >= trunc.min_p * p.max()
        keep[targets[i]] = True
        assert ids[i][ids[i] >= 0].tolist() == keep.nonzero().flatten().tolist()
        restricted = torch.log(probs[i] * keep / (probs[i] * keep).sum())
        torch.testing.assert_close(logps[i], restricted[targets[i]])
        n = min(int(keep.sum()), 4)
        torch.testing.assert_close(top_logps[i, :n], restricted[top_ids[i, :n]])
        assert torch.isinf(top_logps[i, n:]).all()  # past the support: no token of the sampler


@pytest.mark.parametrize("settings", TRUNCATIONS.values(), ids=TRUNCATIONS.keys())
def test_keep_sampling_mask_gives_ratio_one_on_policy(tmp_path, settings) -> None:
    """Batch 0 is sampled with the policy's own weights: renormalised on the sampler's support, the
    policy's log-probs are the sampler's and every importance ratio is 1 (without the mask it is the
    policy's mass on the support, below 1). The sampled tokens are drawn from the support."""
    trainer = async_trainer(tmp_path, generator=None, max_staleness=0, max_steps=1, **settings)
    trainer._start_background(0)
    (chunk,) = trainer._take_batch(0)
    trainer._stop_background()
    kept, r = chunk.sampler_support, chunk.rollout
    assert kept is not None and torch.isfinite(chunk.sampler_logps).all()
    out, _ = trainer._renormalised_forward(trainer.model, chunk, False)
    mask = r.completion_mask.bool()
    torch.testing.assert_close(out.logps[mask], chunk.sampler_logps[mask], rtol=1e-5, atol=1e-5)
    if "top_k" in settings:
        assert int((kept >= 0).sum(-1).max()) <= settings["top_k"]
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert log["loss"] == log["loss"] and abs(log["loss"]) < float("inf")  # top slots past a support count 0


def test_keep_sampling_mask_gradient_is_the_restricted_log_softmax(tmp_path) -> None:
    """The renormalised log-probs and their gradient equal log_softmax of the model's logits with
    every token outside the support at -inf (a stale batch, so the supports are the sampler's)."""
    trainer = async_trainer(tmp_path, generator=None, max_staleness=1, top_k=5, per_device_train_batch_size=8)
    trainer._start_background(0)
    (chunk,) = trainer._take_batch(0)
    trainer._stop_background()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    r, kept = chunk.rollout, chunk.sampler_support
    mask = r.completion_mask.float()
    weights = torch.randn(mask.shape) * mask
    out, _ = trainer._renormalised_forward(trainer.model, chunk, False)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    got = torch.autograd.grad((out.logps * weights).sum(), params)
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)
    attention = torch.cat([r.prompt_mask, r.completion_mask], dim=1)
    T = r.completion_ids.shape[1]
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, -T - 1 : -1].float()
    inside = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, kept.clamp(min=0), kept >= 0)
    restricted = torch.log_softmax(logits.masked_fill(~inside, -torch.inf), dim=-1)
    expected = restricted.gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.logps * mask, expected * mask, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, torch.autograd.grad((expected * weights).sum(), params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_evaluation_scores_on_policy(tmp_path) -> None:
    trainer = async_trainer(tmp_path, per_device_eval_batch_size=4)
    trainer.eval_dataset = standard_dataset(4)
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and trainer.state.log_history[-1]["eval_kl"] == pytest.approx(0.0, abs=1e-5)


def test_resume_is_exact(tmp_path) -> None:
    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = async_trainer(
            out, max_staleness=2, max_steps=5, save_strategy="steps", save_steps=1, learning_rate=0.05
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    saved = torch.load(tmp_path / "stopped" / "checkpoint-2" / "async_batches_rank0.pt", weights_only=False)
    assert [b.index for b in saved["batches"]][:2] == [2, 3]  # made with the weights of steps 0 and 1
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-2"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    versions = lambda t: [h["batch/sampler_version"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert versions(resumed) == versions(straight) == [0.0, 0.0, 0.0, 1.0, 2.0]


def test_resuming_with_another_staleness_is_refused(tmp_path) -> None:
    async_trainer(tmp_path, max_staleness=1, max_steps=1, save_strategy="steps", save_steps=1).train()
    other = async_trainer(tmp_path, max_staleness=2, max_steps=2)
    with pytest.raises(ValueError, match="was saved with max_staleness=1, this run has max_staleness=2"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


def test_a_sampler_slower_than_the_timeout_is_reported(tmp_path) -> None:
    import time

    class Slow(PromptKeyedGenerator):
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            time.sleep(2.0)
            return super().generate(prompt_ids, prompt_mask, **kwargs)

    trainer = async_trainer(tmp_path, generator=Slow, max_steps=1, weight_sync_timeout=0.3)
    with pytest.raises(TimeoutError, match=r"waited 0.3 s for the generation batch of step 0; raise"):
        trainer.train()


def test_a_sampler_failure_reaches_the_trainer(tmp_path) -> None:
    class Failing(PromptKeyedGenerator):
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            raise OSError("disk on fire")

    trainer = async_trainer(tmp_path, generator=Failing, max_steps=2)
    with pytest.raises(RuntimeError, match="background sampler failed: OSError"):
        trainer.train()
    assert trainer.background is None


# ---- two processes --------------------------------------------------------------------------------


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> AsyncGRPOTrainer:
    """Three SGD steps with max_staleness=1 on groups of 4 (the two-process test)."""
    tok = build_tiny_tokenizer()
    args = async_config(
        out_dir, per_device_train_batch_size=per_device, max_steps=3, shuffle_dataset=False, seed=1, **SGD_ARGS,
        **overrides,
    )  # fmt: skip
    return AsyncGRPOTrainer(
        build_tiny_model(tok, seed=3), token_sum_reward, args, standard_dataset(), processing_class=tok
    )


def ddp_generator(trainer: AsyncGRPOTrainer) -> PromptKeyedGenerator:
    return PromptKeyedGenerator()


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    keys = ("reward", "kl", "entropy", "batch/sampler_version", "num_tokens")
    two_processes_against_one(
        "test_async_grpo", ddp_comparable_trainer, SCRIPT, tmp_path, 29587, (4, 8), keys
    )


# ---- posttrain grpo-async -------------------------------------------------------------------------


def test_cli_trains_and_saves(tmp_path, tiny_model_dir, capsys) -> None:
    from posttrain.cli.grpo_async import grpo_async
    from posttrain.cli.main import COMMANDS

    assert COMMANDS["grpo-async"] is grpo_async
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus one?"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    trainer = grpo_async(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(out),
         "--reward_funcs", "helpers.length_reward", "--max_staleness", "1", "--max_steps", "2",
         "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8",
         "--use_cpu", "--bf16", "false", "--report_to", "none", "--save_strategy", "no",
         "--disable_tqdm", "true"]
    )  # fmt: skip
    assert isinstance(trainer, AsyncGRPOTrainer) and trainer.state.global_step == 2
    assert trainer.args.max_staleness == 1
    assert (out / "config.json").exists()
    assert f"posttrain grpo-async: saved the trained model to {out}" in capsys.readouterr().out


def test_a_vision_language_model_samples_and_trains_with_the_images(tmp_path) -> None:
    """Asynchronous GRPO on Qwen2-VL: the thread samples with each prompt's images (the processor
    encodes them), its log-probs come from a teacher-forced pass with the pixels, and the policy's
    loss reads them: on policy (batch 0, ``max_staleness=0``) the sampler's log-probs equal the
    policy's with the images and differ from the policy's without them."""
    import copy

    from vision_models import build_qwen2_vl, image_dataset, logps_with_and_without_images

    model, processor = build_qwen2_vl()
    start = copy.deepcopy(model).eval()
    args = async_config(
        tmp_path, per_device_train_batch_size=4, num_generations=2, max_staleness=0, max_steps=2
    )
    trainer = AsyncGRPOTrainer(model, token_sum_reward, args, image_dataset(4), processing_class=processor)
    batches = []
    take = trainer._take_batch
    trainer._take_batch = lambda step: batches.append(take(step)) or batches[-1]
    visual = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    trainer.train()
    assert any(not torch.equal(visual[n], p) for n, p in trainer.model.named_parameters() if n in visual)
    for scored in batches[0]:
        r = scored.rollout
        assert r.vision is not None and r.vision.has_images
        with_images, without = logps_with_and_without_images(start, r)
        mask = r.completion_mask.bool()
        assert (scored.sampler_logps - with_images).abs()[mask].max() < 1e-5
        assert (scored.sampler_logps - without).abs()[mask].max() > 1e-3
