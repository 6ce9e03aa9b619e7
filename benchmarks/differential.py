"""Differential check of posttrain's GRPOTrainer against the reference (TRL) on identical rollouts.

Run in the benchmark environment, where both libraries are installed::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential.py            # every config (~35 min)
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential.py --only grpo dapo

The parent mode builds a tiny 2-layer Llama (seeded, float32) and a tiny BPE tokenizer whose pad
token is its EOS token (as in SmolLM2) and saves them once to a temporary folder. For each
configuration it then runs each library in its own process (``--lib trl|posttrain --config NAME``),
both loading the model by path on the CPU. Generation is replaced by a ``rollout_func`` that
returns fixed completions (a deterministic function of the prompt, the completion's index in its
group and the call number): some end with EOS, some are cut at ``max_completion_length`` without
EOS (so their padding, the EOS token, must not make them look terminated), and its ``logprobs``
are the initial model's own log-probs plus a known perturbation, so the sampler-correction modes
and the off-policy mask have something to do. Rewards are deterministic functions of the
completion tokens. Each child writes its ``state.log_history`` and final parameters; the parent
compares every metric both log (relative 1e-4 / absolute 1e-6), lists the metrics only one of
them logs, and reports the largest parameter difference.

The reference applies the sampler correction (``vllm_importance_sampling_*``) and logs the
``sampling/*`` metrics only when ``use_vllm=True``, even when ``rollout_func`` supplies the
sampler's log-probs, and vLLM is not installed here. So the reference runs with its vLLM flag
switched on after construction (``use_vllm=True`` and a no-op weight sync): the rollout_func
replaces generation either way, and this is the path on which the reference uses the
rollout_func's log-probs. The configuration ``trl_without_vllm_flag`` runs the reference
without it, to show that departure.

Nothing here is copied from the reference; it only calls both libraries' public API.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
G = 4  # num_generations
MAX_LEN = 8  # max_completion_length
PROMPTS = [
    "What is 2 + 3?",
    "Name a colour.",
    "Count to three.",
    "Say hello.",
    "Write one word.",
    "What is the sky?",
    "Pick a number.",
    "Tell a tiny story.",
]

# Options shared by every configuration (both libraries get exactly these).
BASE = {
    "per_device_train_batch_size": 2 * G,  # two prompts per step
    "num_generations": G,
    "max_completion_length": MAX_LEN,
    "max_steps": 3,
    "learning_rate": 0.5,
    "optim": "sgd",
    "lr_scheduler_type": "constant",
    "seed": 0,
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "disable_tqdm": True,
    "gradient_checkpointing": False,
    "disable_dropout": True,
    "shuffle_dataset": False,
    "log_completions": False,
    "dataloader_num_workers": 0,
}

# name -> (overrides, description). Unless said otherwise the sampler correction is on (the default of
# both: sequence_mask, clip_max 3.0).
CONFIGS: dict[str, tuple[dict, str]] = {
    "grpo": ({"loss_type": "grpo"}, "loss_type=grpo"),
    "dapo": ({"loss_type": "dapo"}, "loss_type=dapo (default)"),
    "dr_grpo": ({"loss_type": "dr_grpo"}, "loss_type=dr_grpo"),
    "bnpo": ({"loss_type": "bnpo"}, "loss_type=bnpo"),
    "cispo": ({"loss_type": "cispo", "num_iterations": 2}, "loss_type=cispo, num_iterations=2"),
    "cispo_eps_max_5": (
        {"loss_type": "cispo", "num_iterations": 2, "epsilon_high": 5.0},
        "loss_type=cispo, epsilon_high=5.0 given, num_iterations=2",
    ),
    "sapo": ({"loss_type": "sapo", "num_iterations": 2}, "loss_type=sapo, num_iterations=2"),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "num_iterations": 2},
        "GSPO: grpo + importance_sampling_level=sequence, num_iterations=2",
    ),
    "luspo": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "num_iterations": 2},
        "loss_type=luspo (sequence level), num_iterations=2",
    ),
    "vespo": (
        {"loss_type": "vespo", "vllm_importance_sampling_mode": "token_truncate", "num_iterations": 2},
        "loss_type=vespo, IS token_truncate, num_iterations=2",
    ),
    "vespo_is_off": (
        {"loss_type": "vespo", "vllm_importance_sampling_correction": False, "num_iterations": 2},
        "loss_type=vespo, sampler correction off, num_iterations=2",
    ),
    "num_iterations_2": ({"num_iterations": 2, "epsilon": 0.05}, "dapo, num_iterations=2, epsilon=0.05"),
    "epsilon_high": (
        {"num_iterations": 2, "epsilon": 0.05, "epsilon_high": 0.1},
        "dapo, num_iterations=2, epsilon=0.05, epsilon_high=0.1",
    ),
    "delta": (
        {"num_iterations": 2, "epsilon": 0.05, "delta": 1.05},
        "two-sided clip delta=1.05, num_iterations=2",
    ),
    "delta_above_clip": (
        {"num_iterations": 2, "epsilon": 0.05, "delta": 1.2},
        "two-sided clip delta=1.2 > 1 + epsilon_high, num_iterations=2",
    ),
    "clip_band": (
        {"num_iterations": 2, "epsilon": 0.05, "epsilon_high": 0.1, "learning_rate": 0.1},
        "num_iterations=2, epsilon=0.05, epsilon_high=0.1, lr 0.1 (a third of the tokens clipped)",
    ),
    "clip_band_delta": (
        {"num_iterations": 2, "epsilon": 0.05, "delta": 1.1, "learning_rate": 0.1},
        "num_iterations=2, epsilon=0.05, delta=1.1, lr 0.1",
    ),
    "beta_kl": ({"beta": 0.1}, "beta=0.1, use_bias_correction_kl=True (default)"),
    "beta_kl_nobias": (
        {"beta": 0.1, "use_bias_correction_kl": False},
        "beta=0.1, use_bias_correction_kl=False",
    ),
    "beta_kl_iter2": ({"beta": 0.1, "num_iterations": 2}, "beta=0.1, num_iterations=2"),
    "sync_ref_model": (
        {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.6},
        "beta=0.1, TR-DPO reference sync every step, alpha=0.6",
    ),
    "top_entropy": ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
    # GMPO through each library's own GMPOConfig / GMPOTrainer (TRL: trl.experimental.gmpo)
    # (the reference's GMPO loss leaves out the sampler correction: compared with it off on both sides)
    "gmpo_api": (
        {"vllm_importance_sampling_correction": False},
        "GMPOConfig / GMPOTrainer, their defaults (epsilon 0.4 in log space), IS correction off",
    ),
    "gmpo_api_iter2": (
        {"num_iterations": 2, "vllm_importance_sampling_correction": False},
        "GMPOConfig / GMPOTrainer, num_iterations=2, IS correction off",
    ),
    "mask_truncated": ({"mask_truncated_completions": True}, "mask_truncated_completions=True"),
    "mask_truncated_grpo": (
        {"mask_truncated_completions": True, "loss_type": "grpo"},
        "mask_truncated_completions=True, loss_type=grpo",
    ),
    "scale_batch": ({"scale_rewards": "batch"}, "scale_rewards=batch"),
    "scale_none": ({"scale_rewards": "none"}, "scale_rewards=none"),
    "normalize_then_sum": (
        {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [1.0, 0.5]},
        "multi_objective_aggregation=normalize_then_sum, reward_weights=[1, 0.5]",
    ),
    "is_token_truncate": (
        {
            "vllm_importance_sampling_mode": "token_truncate",
            "vllm_importance_sampling_clip_max": 1.2,
            "vllm_importance_sampling_clip_min": 0.8,
        },
        "IS token_truncate [0.8, 1.2]",
    ),
    "is_token_mask": (
        {
            "vllm_importance_sampling_mode": "token_mask",
            "vllm_importance_sampling_clip_max": 1.2,
            "vllm_importance_sampling_clip_min": 0.8,
        },
        "IS token_mask [0.8, 1.2]",
    ),
    "is_sequence_truncate": (
        {
            "vllm_importance_sampling_mode": "sequence_truncate",
            "vllm_importance_sampling_clip_max": 2.0,
            "vllm_importance_sampling_clip_min": 0.5,
        },
        "IS sequence_truncate [0.5, 2]",
    ),
    "is_sequence_mask": (
        {
            "vllm_importance_sampling_mode": "sequence_mask",
            "vllm_importance_sampling_clip_max": 2.0,
            "vllm_importance_sampling_clip_min": 0.5,
        },
        "IS sequence_mask [0.5, 2]",
    ),
    "is_off": ({"vllm_importance_sampling_correction": False}, "vllm_importance_sampling_correction=False"),
    "off_policy_mask": ({"off_policy_mask_threshold": 0.05}, "off_policy_mask_threshold=0.05"),
    "entropy_coef": ({"entropy_coef": 0.01}, "entropy_coef=0.01"),
    "adaptive_entropy": (
        {
            "entropy_coef": 0.01,
            "use_adaptive_entropy": True,
            "entropy_target": 10.0,
            "entropy_coef_delta": 0.01,
        },
        "adaptive entropy, target 10 nats",
    ),
    "grad_accum": (
        {"per_device_train_batch_size": G, "gradient_accumulation_steps": 2},
        "dapo, 2 micro-batches of 4 accumulated",
    ),
    "grad_accum_grpo": (
        {"per_device_train_batch_size": G, "gradient_accumulation_steps": 2, "loss_type": "grpo"},
        "grpo, 2 micro-batches of 4 accumulated",
    ),
    "temperature": ({"temperature": 0.7}, "temperature=0.7 (log-probs and entropy of logits / 0.7)"),
    "trl_without_vllm_flag": ({}, "dapo defaults; the reference run WITHOUT its vLLM flag"),
    "tied_embeddings": (
        {"loss_type": "grpo"},
        "grpo on a model whose LM head is tied to its input embeddings (SmolLM2's shape)",
    ),
    "tied_embeddings_grad_accum": (
        {"per_device_train_batch_size": G, "gradient_accumulation_steps": 2},
        "dapo, 2 micro-batches accumulated, LM head tied to the input embeddings",
    ),
}

#: The configurations whose tiny model ties its LM head to its input embeddings.
TIED = {"tied_embeddings", "tied_embeddings_grad_accum"}


# ----------------------------------------------------------------------------------------------
# Shared pieces: model, rollouts, rewards


CORPUS = [
    "What is 2 + 3? <answer>5</answer>",
    "The sky is blue and the sun is bright.",
    "Write a short story about a cat who learns arithmetic.",
    "one two three four five six seven eight nine ten",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>",
] * 20


def build_model_dir(path: str, tied: bool = False) -> None:
    """Save a seeded tiny Llama and a tiny BPE tokenizer whose pad token is EOS (as in SmolLM2);
    with ``tied``, its LM head is its input embedding matrix.

    The same construction as the test suite's ``tests/conftest.py`` (which needs pytest, absent here).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)


def record_failure(out_path: str, result: dict, exc: BaseException) -> None:
    """A child's result when its library refused or failed the configuration."""
    import traceback

    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = traceback.format_exc()[-3000:]
    with open(out_path, "w") as f:
        json.dump(result, f)


def train_and_record(out_path: str, result: dict, make_trainer) -> None:
    """A child's whole run: ``make_trainer(folder)`` builds the trainer in a temporary output folder,
    it trains, and the result is recorded (``record_run``), or the refusal (``record_failure``)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trainer = make_trainer(tmp)
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - recorded as "not accepted"
            record_failure(out_path, result, exc)
            return
        record_run(out_path, result, trainer)


def record_run(out_path: str, result: dict, trainer) -> None:
    """A child's result after training: the log history, and the parameters beside it (``.pt``)."""
    import torch

    result["log_history"] = trainer.state.log_history
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    torch.save({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, out_path + ".pt")
    with open(out_path, "w") as f:
        json.dump(result, f, default=float)


def prepare_tiny(work: str, tied: bool = False) -> tuple[str, str]:
    """The tiny model's folder under ``work`` (built once) and its saved initial parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    suffix = "_tied" if tied else ""
    model_dir = os.path.join(work, "model" + suffix)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_model_dir(model_dir, tied)
    init_path = os.path.join(work, f"init{suffix}.pt")
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.save({k: v.detach().float() for k, v in m.state_dict().items()}, init_path)
    return model_dir, init_path


def rollout_plan(prompt: str, index: int, call: int, vocab: int, specials: set[int], eos: int):
    """Fixed completion and sampler-log-prob perturbation for (prompt, index in group, call)."""
    import numpy as np

    seed = (sum(map(ord, prompt)) * 1009 + index * 31 + call * 7919) % (2**31)
    rng = np.random.RandomState(seed)
    allowed = [t for t in range(vocab) if t not in specials]
    # 0: short, ends EOS; 1: truncated (max len, no EOS); 2: max len ending in EOS; 3: mid + EOS
    kind = index % 4
    if kind == 0:
        body = list(rng.choice(allowed, size=int(rng.randint(1, 4))))
        ids = [*body, eos]
    elif kind == 1:
        ids = list(rng.choice(allowed, size=MAX_LEN))
    elif kind == 2:
        ids = [*rng.choice(allowed, size=MAX_LEN - 1), eos]
    else:
        ids = [*rng.choice(allowed, size=int(rng.randint(3, 6))), eos]
    ids = [int(t) for t in ids]
    # Per-sequence offset (sampler log-prob minus true log-prob) plus per-token noise.
    offset = [-0.15, 0.0, 0.08, 0.3][(index + call) % 4]
    noise = rng.normal(0.0, 0.05, size=len(ids))
    return ids, [offset + float(n) for n in noise]


class Rollouts:
    """The rollout_func: identical completions and sampler log-probs in both libraries."""

    def __init__(self, model_dir: str, lib: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        self.lib = lib
        self.calls = 0
        self.received: list[int] = []

    def __call__(self, prompts, trainer):
        import torch

        self.received.append(len(prompts))
        # The reference hands every row's prompt (each repeated num_generations times); posttrain hands each
        # prompt once. Both must get back one entry per completion, num_generations per prompt, in order.
        if self.lib == "trl":
            unique = list(prompts[::G])
            assert all(prompts[i] == unique[i // G] for i in range(len(prompts))), "unexpected prompt layout"
        else:
            unique = list(prompts)
        eos = self.tok.eos_token_id
        specials = set(self.tok.all_special_ids)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "group_index": []}
        for p in unique:
            p_ids = self.tok(p, add_special_tokens=False)["input_ids"]
            for j in range(G):
                ids, perturb = rollout_plan(p, j, self.calls, len(self.tok), specials, eos)
                with torch.no_grad():
                    logits = self.model(torch.tensor([p_ids + ids])).logits[0, len(p_ids) - 1 : -1].float()
                    true = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                out["prompt_ids"].append(p_ids)
                out["completion_ids"].append(ids)
                out["logprobs"].append([float(t) + d for t, d in zip(true.tolist(), perturb, strict=True)])
                out["group_index"].append(j)
        self.calls += 1
        return out


def switch_on_vllm_flag(trainer) -> None:
    """Put the reference's GRPOTrainer on its vLLM path after construction, with a no-op weight sync.

    The reference uses rollout_func's log-probs only when ``use_vllm`` is on; vLLM is not installed
    here, and the rollout_func generates either way.
    """

    class _NoSync:
        def sync_weights(self):
            pass

    trainer.use_vllm = True
    trainer.vllm_generation = _NoSync()
    trainer._last_loaded_step = -1


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def length_reward(completion_ids, group_index=None, **kwargs):
    # Uses the extra field the rollout_func returns, so forwarding it is checked too.
    return [0.1 * len(ids) - 0.2 * g for ids, g in zip(completion_ids, group_index, strict=True)]


# ----------------------------------------------------------------------------------------------
# Child: one library, one configuration


def run_child(lib: str, name: str, model_dir: str, out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset

    if name.startswith("gmpo_api"):  # each library's GMPO classes, under GRPO's names here
        if lib == "trl":
            from trl.experimental.gmpo import GMPOConfig as GRPOConfig
            from trl.experimental.gmpo import GMPOTrainer as GRPOTrainer
        else:
            from posttrain import GMPOConfig as GRPOConfig
            from posttrain import GMPOTrainer as GRPOTrainer
    elif lib == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from posttrain import GRPOConfig, GRPOTrainer

    overrides, _ = CONFIGS[name]
    rollouts = Rollouts(model_dir, lib)
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    result: dict = {"lib": lib, "config": name}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = GRPOConfig(output_dir=tmp, **{**BASE, **overrides})
            trainer = GRPOTrainer(
                model=model_dir,
                reward_funcs=[token_sum_reward, length_reward],
                args=args,
                train_dataset=dataset,
                rollout_func=rollouts,
            )
            if lib == "trl" and name != "trl_without_vllm_flag":
                switch_on_vllm_flag(trainer)
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - recorded as "not accepted"
            record_failure(out_path, result, exc)
            return
        result["rollout_calls"] = rollouts.received
        record_run(out_path, result, trainer)


# ----------------------------------------------------------------------------------------------
# Parent: drive both libraries and compare

SKIP = ("time", "runtime", "per_second", "flos")
RTOL, ATOL = 1e-4, 1e-6


def step_metrics(result: dict) -> list[dict]:
    """Per-step metric dicts (the training summary entry is compared as one more 'step')."""
    rows = []
    for entry in result["log_history"]:
        rows.append(
            {k: v for k, v in entry.items() if not any(s in k for s in SKIP) and isinstance(v, (int, float))}
        )
    return rows


def rel(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    d = abs(a - b)
    if d <= ATOL:
        return 0.0
    return d / max(abs(a), abs(b))


def compare(trl: dict, pt: dict) -> dict:
    import torch

    out: dict = {"only_trl": set(), "only_posttrain": set(), "worst": None, "bad": []}
    ta, pa = step_metrics(trl), step_metrics(pt)
    if len(ta) != len(pa):
        out["bad"].append(("<log entries>", len(ta), len(pa), math.inf, -1))
    worst = (-1.0, None)
    for step, (t, p) in enumerate(zip(ta, pa, strict=False)):
        out["only_trl"] |= set(t) - set(p)
        out["only_posttrain"] |= set(p) - set(t)
        for k in sorted(set(t) & set(p)):
            r = rel(float(t[k]), float(p[k]))
            if r > worst[0]:
                worst = (r, (k, t[k], p[k], step))
            if r > RTOL:
                out["bad"].append((k, t[k], p[k], r, step))
    out["worst"] = worst
    tp = torch.load(trl["_pt"]) if "_pt" in trl else None
    pp = torch.load(pt["_pt"]) if "_pt" in pt else None
    init = torch.load(trl["_init"])
    maxdiff, maxupd = 0.0, 0.0
    for k, v in tp.items():
        maxdiff = max(maxdiff, (v - pp[k]).abs().max().item())
        maxupd = max(maxupd, (v - init[k]).abs().max().item())
    out["param_maxdiff"], out["param_maxupdate"] = maxdiff, maxupd
    out["agree"] = not out["bad"] and maxdiff <= max(1e-5, 1e-4 * maxupd)
    return out


def fmt(x) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}


def drive(names, work: str, child_args, init_path, note=None, verbose: bool = False, column=None) -> int:
    """Run each configuration in both libraries (one process each), compare, print a line per
    configuration and the markdown table. Shared by the differential scripts.

    Args:
        names: the configurations, in order.
        work: the folder the results go to.
        child_args: ``child_args(lib, name, out_path)``, the child's command-line arguments.
        init_path: ``init_path(name)``, the saved initial parameters the configuration starts from.
        note: ``note(results)``, more to print on a configuration's line (or ``None``).
        column: ``(header, cell)``, one more table column: ``cell(results)`` gives a compared
            configuration's entry (or ``None``: no such column).
    """
    env = {**os.environ, **CHILD_ENV}
    rows = []
    t0 = time.time()
    for name in names:
        res = {}
        for lib in ("trl", "posttrain"):
            path = os.path.join(work, f"{name}.{lib}.json")
            cmd = [sys.executable, *child_args(lib, name, path)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if not os.path.exists(path):
                res[lib] = {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
                continue
            with open(path) as f:
                res[lib] = json.load(f)
            if os.path.exists(path + ".pt"):
                res[lib]["_pt"] = path + ".pt"
            res[lib]["_init"] = init_path(name)
        errs = {lib: r["error"] for lib, r in res.items() if "error" in r}
        if errs:
            rows.append((name, "NOT COMPARED", "; ".join(f"{k}: {v[:200]}" for k, v in errs.items()), "", ""))
            print(f"[{name}] not compared: {errs}", flush=True)
            if verbose:
                for r in res.values():
                    print(r.get("traceback", ""))
            continue
        c = compare(res["trl"], res["posttrain"])
        w = c["worst"][1]
        if w is None or c["worst"][0] == 0.0:
            worst = "all equal"
        else:
            worst = f"{w[0]} (step {w[3]}): trl {fmt(w[1])} / posttrain {fmt(w[2])}"
        status = "agree" if c["agree"] else "DIFFER"
        params = f"{c['param_maxdiff']:.2e} (update {c['param_maxupdate']:.2e})"
        rows.append((name, status, worst, params, column[1](res) if column is not None else ""))
        extra = f"; {note(res)}" if note is not None else ""
        print(f"[{name}] {status}; worst {worst}; params {params}{extra}", flush=True)
        if c["only_trl"] or c["only_posttrain"]:
            print(f"    only trl: {sorted(c['only_trl'])}; only posttrain: {sorted(c['only_posttrain'])}")
        if verbose or not c["agree"]:
            for k, a, b, r, step in c["bad"][:12]:
                print(f"    step {step}: {k}: trl {fmt(a)} posttrain {fmt(b)} (rel {r:.2e})")
    print(f"\n{len(names)} configurations in {time.time() - t0:.0f}s; work folder {work}\n")
    head, line = (
        "| config | result | worst metric (step): trl / posttrain | max param diff |",
        "|---|---|---|---|",
    )
    if column is not None:
        head, line = f"{head} {column[0]} |", f"{line}---|"
    print(head)
    print(line)
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" + (f" {r[4]} |" if column is not None else ""))
    return 0


def generation_calls_note(res: dict) -> str:
    """The note of a scripted-generation row: how many generation calls each library made."""
    return f"generation calls trl {res['trl']['calls']} posttrain {res['posttrain']['calls']}"


def drive_tiny(names, keep: str | None, verbose: bool, script: str, prefix: str, note) -> int:
    """``drive`` for scripts whose children take ``--model_dir``: the tiny model, built once."""
    work = keep or tempfile.mkdtemp(prefix=prefix)
    models = {tied: prepare_tiny(work, tied) for tied in {name in TIED for name in names}}

    def child_args(lib: str, name: str, out: str) -> list[str]:
        model_dir = models[name in TIED][0]
        return [script, "--lib", lib, "--config", name, "--model_dir", model_dir, "--out", out]

    return drive(names, work, child_args, lambda name: models[name in TIED][1], note, verbose)


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    def note(res: dict) -> str:
        return f"rollout_func calls trl {res['trl']['rollout_calls']} posttrain {res['posttrain']['rollout_calls']}"

    return drive_tiny(names, keep, verbose, os.path.abspath(__file__), "differential-", note)


def command_line(doc: str, configs: dict, run_child, run_parent, child_folder: str = "model_dir") -> int:
    """The differential scripts' command line: a child run (``--lib --config --out`` and
    ``--model_dir`` or ``--work``, as ``child_folder`` says) or the parent over ``--only``
    configurations (names, or family prefixes such as ``dpo``: every ``dpo_*``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--lib", choices=["trl", "posttrain"])
    parser.add_argument("--config", choices=list(configs))
    parser.add_argument("--model_dir")
    parser.add_argument("--out")
    parser.add_argument("--only", nargs="*", help="configurations or family prefixes to run (default: all)")
    parser.add_argument("--work", help="folder to keep the models and results in (default: a temporary one)")
    parser.add_argument("--verbose", action="store_true")
    opts = parser.parse_args()
    if opts.lib:
        run_child(opts.lib, opts.config, getattr(opts, child_folder), opts.out)
        return 0
    names = list(configs)
    if opts.only:
        names = [n for n in configs if n in opts.only or any(n.startswith(f"{p}_") for p in opts.only)]
        unknown = [
            o for o in opts.only if o not in configs and not any(n.startswith(f"{o}_") for n in configs)
        ]
        if unknown:
            parser.error(f"unknown configs {unknown}; choose from {list(configs)}")
    return run_parent(names, opts.work, opts.verbose)


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent)


if __name__ == "__main__":
    sys.exit(main())
