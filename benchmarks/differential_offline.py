"""Differential check of posttrain's offline trainers against the reference (TRL 1.16) on identical data.

Run in the benchmark environment, where both libraries are installed::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_offline.py              # every config
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_offline.py --only dpo_ipo kto

Families: SFT, DPO (every loss type of the reference, a loss mixture, the f-divergences), KTO,
ORPO, CPO (sigmoid, hinge, IPO, SimPO, AlphaPO), reward modelling, and GKD on dataset
completions (``lmbda=0``: nothing generated). The parent builds the tiny seeded Llama and BPE
tokenizer of ``differential.py`` (pad token = EOS, as SmolLM2), a sequence-classification copy
for the reward trainer and a second seed as GKD's teacher, and saves them once. For each
configuration each library runs in its own process (``--lib trl|posttrain --config NAME``), loads
the model by path on the CPU and trains 3 full-batch steps of plain SGD on the same eight rows.
The parent compares every metric both log (relative 1e-4 / absolute 1e-6), lists the metrics only
one of them logs, and reports the largest parameter difference after the 3 steps.

Nothing here is copied from the reference; it only calls both libraries' public API.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from differential import build_model_dir, command_line, drive, train_and_record  # noqa: E402

ROWS = 8
BASE = {
    "per_device_train_batch_size": ROWS,  # every step is the whole data set: no sampler order to match
    "max_steps": 3,
    "learning_rate": 0.1,
    "optim": "sgd",
    "lr_scheduler_type": "constant",
    "max_grad_norm": 0.0,
    "seed": 0,
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "logging_steps": 1,
    "save_strategy": "no",
    "disable_tqdm": True,
    "gradient_checkpointing": False,
    "dataloader_num_workers": 0,
}

QUESTIONS = [
    "What is 2 + 3?",
    "Name a colour.",
    "Count to three.",
    "Say hello.",
    "Write one word.",
    "What is the sky?",
    "Pick a number.",
    "Tell a tiny story.",
]
GOOD = ["5", "blue", "one two three", "hello", "cat", "blue and bright", "seven", "A cat learns to count."]
BAD = ["7", "the", "three two", "bye now then", "sky sky", "green", "a lot of numbers", "No."]


def data(kind: str):
    """The eight rows each family trains on (standard, not conversational: no chat template in play)."""
    from datasets import Dataset

    if kind == "text":
        return Dataset.from_dict({"text": [f"{q} {a}" for q, a in zip(QUESTIONS, GOOD, strict=True)]})
    if kind == "prompt_completion":
        return Dataset.from_dict({"prompt": QUESTIONS, "completion": [f" {a}" for a in GOOD]})
    if kind == "preference":
        return Dataset.from_dict(
            {"prompt": QUESTIONS, "chosen": [f" {a}" for a in GOOD], "rejected": [f" {b}" for b in BAD]}
        )
    if kind == "implicit":  # reward modelling: the prompt inside each side
        return Dataset.from_dict(
            {
                "chosen": [f"{q} {a}" for q, a in zip(QUESTIONS, GOOD, strict=True)],
                "rejected": [f"{q} {b}" for q, b in zip(QUESTIONS, BAD, strict=True)],
            }
        )
    if kind == "unpaired":  # KTO: each question with its good (desirable) and bad completion, alternating
        rows = [
            (q, f" {g}" if i % 2 == 0 else f" {b}", i % 2 == 0)
            for i, (q, g, b) in enumerate(zip(QUESTIONS, GOOD, BAD, strict=True))
        ]
        return Dataset.from_dict(
            {
                "prompt": [r[0] for r in rows],
                "completion": [r[1] for r in rows],
                "label": [r[2] for r in rows],
            }
        )
    if kind == "conversations":  # GKD: prompt and completion as messages
        return Dataset.from_dict(
            {
                "messages": [
                    [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                    for q, a in zip(QUESTIONS, GOOD, strict=True)
                ]
            }
        )
    raise ValueError(kind)


# family -> (posttrain names, reference module and names, data kind, model kind)
FAMILIES = {
    "sft": (("SFTConfig", "SFTTrainer"), ("trl", "SFTConfig", "SFTTrainer"), "lm"),
    "dpo": (("DPOConfig", "DPOTrainer"), ("trl", "DPOConfig", "DPOTrainer"), "lm"),
    "kto": (("KTOConfig", "KTOTrainer"), ("trl.experimental.kto", "KTOConfig", "KTOTrainer"), "lm"),
    "orpo": (("ORPOConfig", "ORPOTrainer"), ("trl.experimental.orpo", "ORPOConfig", "ORPOTrainer"), "lm"),
    "cpo": (("CPOConfig", "CPOTrainer"), ("trl.experimental.cpo", "CPOConfig", "CPOTrainer"), "lm"),
    "reward": (("RewardConfig", "RewardTrainer"), ("trl", "RewardConfig", "RewardTrainer"), "classifier"),
    "gkd": (("GKDConfig", "GKDTrainer"), ("trl.experimental.gkd", "GKDConfig", "GKDTrainer"), "lm"),
}

DPO_LOSSES = [
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
# Options a loss type needs to be accepted (the reference's rules).
DPO_NEEDS = {"exo_pair": {"label_smoothing": 0.1}, "robust": {"label_smoothing": 0.1}}

# name -> (family, data kind, overrides)
CONFIGS: dict[str, tuple[str, str, dict]] = {
    "sft_text": ("sft", "text", {}),
    "sft_prompt_completion": ("sft", "prompt_completion", {}),
    "sft_completion_and_prompt_loss": ("sft", "prompt_completion", {"completion_only_loss": False}),
    "sft_dft": ("sft", "prompt_completion", {"loss_type": "dft"}),
    "sft_packing_bfd": ("sft", "text", {"packing": True, "max_length": 16}),
    "sft_packing_wrapped": (
        "sft",
        "text",
        {"packing": True, "packing_strategy": "wrapped", "max_length": 16},
    ),
    **{
        f"dpo_{loss}": ("dpo", "preference", {"loss_type": loss, **DPO_NEEDS.get(loss, {})})
        for loss in DPO_LOSSES
    },
    "dpo_sigmoid_plus_sft": (
        "dpo",
        "preference",
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    ),
    "dpo_ld_alpha": ("dpo", "preference", {"ld_alpha": 0.5}),
    "dpo_forward_kl": ("dpo", "preference", {"f_divergence_type": "forward_kl"}),
    "dpo_js_divergence": ("dpo", "preference", {"f_divergence_type": "js_divergence"}),
    "dpo_alpha_divergence": ("dpo", "preference", {"f_divergence_type": "alpha_divergence"}),
    "dpo_use_weighting": ("dpo", "preference", {"use_weighting": True}),
    "kto": ("kto", "unpaired", {}),
    "kto_weights": ("kto", "unpaired", {"desirable_weight": 1.5, "undesirable_weight": 0.5}),
    "kto_apo_zero_unpaired": ("kto", "unpaired", {"loss_type": "apo_zero_unpaired"}),
    "orpo": ("orpo", "preference", {}),
    "cpo_sigmoid": ("cpo", "preference", {}),
    "cpo_hinge": ("cpo", "preference", {"loss_type": "hinge"}),
    "cpo_ipo": ("cpo", "preference", {"loss_type": "ipo"}),
    "cpo_simpo": ("cpo", "preference", {"loss_type": "simpo", "cpo_alpha": 0.0}),
    "cpo_alphapo": ("cpo", "preference", {"loss_type": "alphapo", "alpha": 0.5}),
    "reward": ("reward", "implicit", {}),
    "reward_centered": ("reward", "implicit", {"center_rewards_coefficient": 0.01}),
    "gkd_jsd": ("gkd", "conversations", {"lmbda": 0.0, "beta": 0.5}),
    "gkd_forward_kl": ("gkd", "conversations", {"lmbda": 0.0, "beta": 0.0}),
    "gkd_reverse_kl": ("gkd", "conversations", {"lmbda": 0.0, "beta": 1.0}),
}
# posttrain samples KTO's rows at random by default and pairs each row with the previous one of its
# micro-batch for the KL estimate; sequential sampling (the reference's forced default) gives both
# libraries the same pairs.
FAMILY_BASE = {"kto": {"train_sampling_strategy": "sequential"}, "gkd": {"max_new_tokens": 8}}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_models(work: str) -> dict[str, str]:
    """The policy (differential.py's tiny Llama, with a chat template), a reward-model copy with a
    seeded score head, and a teacher of another seed."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, LlamaForSequenceClassification

    paths = {k: os.path.join(work, k) for k in ("lm", "classifier", "teacher")}
    if not os.path.exists(os.path.join(paths["lm"], "config.json")):
        build_model_dir(paths["lm"])
        tok = AutoTokenizer.from_pretrained(paths["lm"])
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(paths["lm"])
        lm = LlamaForCausalLM.from_pretrained(paths["lm"])
        torch.manual_seed(1)
        config = lm.config.__class__.from_dict({**lm.config.to_dict(), "num_labels": 1})
        classifier = LlamaForSequenceClassification(config)
        classifier.model.load_state_dict(lm.model.state_dict())
        classifier.save_pretrained(paths["classifier"])
        tok.save_pretrained(paths["classifier"])
        torch.manual_seed(2)
        LlamaForCausalLM(lm.config).save_pretrained(paths["teacher"])
        tok.save_pretrained(paths["teacher"])
    return paths


def run_child(lib: str, name: str, work: str, out_path: str) -> None:
    import importlib

    import torch

    torch.set_num_threads(1)
    family, kind, overrides = CONFIGS[name]
    ours, theirs, model_kind = FAMILIES[family]
    if lib == "trl":
        module = importlib.import_module(theirs[0])
        config_class, trainer_class = getattr(module, theirs[1]), getattr(module, theirs[2])
    else:
        module = importlib.import_module("posttrain")
        config_class, trainer_class = getattr(module, ours[0]), getattr(module, ours[1])
    paths = build_models(work)

    def make_trainer(folder: str):
        args = config_class(output_dir=folder, **{**BASE, **FAMILY_BASE.get(family, {}), **overrides})
        extra = {}
        if family == "gkd":  # the reference's GKD needs the tokenizer given
            from transformers import AutoTokenizer

            extra = {
                "teacher_model": paths["teacher"],
                "processing_class": AutoTokenizer.from_pretrained(paths["lm"]),
            }
        return trainer_class(model=paths[model_kind], args=args, train_dataset=data(kind), **extra)

    train_and_record(out_path, {"lib": lib, "config": name}, make_trainer)


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    work = keep or tempfile.mkdtemp(prefix="differential-offline-")
    paths = build_models(work)
    inits = {}
    for kind, loader in (("lm", AutoModelForCausalLM), ("classifier", AutoModelForSequenceClassification)):
        m = loader.from_pretrained(paths[kind], dtype=torch.float32)
        inits[kind] = os.path.join(work, f"init-{kind}.pt")
        torch.save({k: v.detach().float() for k, v in m.state_dict().items()}, inits[kind])
    script = os.path.abspath(__file__)
    return drive(
        names,
        work,
        lambda lib, name, out: [script, "--lib", lib, "--config", name, "--work", work, "--out", out],
        lambda name: inits[FAMILIES[CONFIGS[name][0]][2]],
        None,
        verbose,
    )


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent, "work")


if __name__ == "__main__":
    sys.exit(main())
