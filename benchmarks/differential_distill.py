"""Differential check of posttrain's teacher-student trainers (distillation, GOLD, IW-OPD) against the reference (TRL 1.16).

Run in the benchmark environment, where both libraries are installed::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_distill.py
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_distill.py --only distill gold_jsd

Families: ``DistillationTrainer`` (reference: ``trl.DistillationTrainer``), ``GOLDTrainer``
(``trl.experimental.gold``, the same-tokenizer JSD) and ``IWOPDTrainer``
(``trl.experimental.iw_opd``). The student is ``differential_offline.build_models``' tiny seeded
Llama (pad token = EOS, a ChatML template), the teacher the same architecture and vocabulary with
another seed. Every step is the whole data set (eight rows, so the libraries' samplers need not
agree on an order) and 3 plain-SGD steps (``differential_offline.BASE``).

Where the student samples (the distillation trainer always; GOLD and IW-OPD with ``lmbda=1``),
neither reference trainer takes a ``rollout_func``, so each library's generation is replaced in
place by the same scripted completions (``MixedScript``, ``differential_online.Script`` with the
completion's kind, from ``differential.rollout_plan``, also a function of the prompt, so that one
batch mixes completions that end with EOS at different lengths and ones cut at
``max_completion_length`` without it):

- the reference's ``DistillationTrainer._generate_single_turn(prompt_ids, images,
  multimodal_fields)`` (which returns each row's completion ids), replaced by one returning the
  script's;
- the reference's GOLD and IW-OPD sample with the student's ``model.generate`` (their non-vLLM
  path: ``generate_on_policy_outputs`` / ``_generate_with_model`` read its ``.sequences``), so
  ``trainer.model.generate`` is replaced by one returning ``[prompt | scripted completion]`` rows,
  right padded (``differential_online.scripted_generate``);
- posttrain's generator (``trainer.generator``, the same object as ``trainer.sampler.generator``,
  whose ``generate(prompt_ids, prompt_mask)`` returns ``Samples``), replaced by one returning the
  script's completions.

With ``lmbda=0`` (GOLD, IW-OPD's ``jsd``) nothing is generated: both train on the dataset's
``messages`` completions (``differential_offline.data("conversations")``). Everything after
generation is each library's own. The table's last column is each side's step-1 ``loss``; the
comparison (every metric both log, relative 1e-4 / absolute 1e-6, and the parameters after the
3 steps) is ``differential.py``'s.

Two things the comparison allows for. The reference's GOLD and IW-OPD divide an on-policy step's
loss by the number of the *dataset's* completion tokens (transformers counts ``num_items_in_batch``
from the dataloader's labels, before the student's samples replace them; posttrain counts the
tokens it trains on, docs/distillation.md), so the ``*_same_count`` configurations script each
completion with as many tokens as the row's dataset completion (``dataset_lengths``), where the two
counts agree and the losses can be compared. And the reference logs ``on_policy_loss`` /
``off_policy_loss`` rounded to 4 decimals, so both children round them so too (``loss`` itself
is compared unrounded).

Nothing here is copied from the reference; it only calls both libraries' public API and replaces
one generation method of each.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from differential import (  # noqa: E402
    MAX_LEN,
    command_line,
    drive,
    generation_calls_note,
    record_failure,
    record_run,
    rollout_plan,
)
from differential_offline import BASE, QUESTIONS, build_models, data  # noqa: E402
from differential_online import Script, script_posttrain, scripted_generate  # noqa: E402

# family -> (posttrain names, reference module and names)
FAMILIES = {
    "distill": (
        ("DistillationConfig", "DistillationTrainer"),
        ("trl", "DistillationConfig", "DistillationTrainer"),
    ),
    "gold": (("GOLDConfig", "GOLDTrainer"), ("trl.experimental.gold", "GOLDConfig", "GOLDTrainer")),
    "iw_opd": (("IWOPDConfig", "IWOPDTrainer"), ("trl.experimental.iw_opd", "IWOPDConfig", "IWOPDTrainer")),
}
#: Each family's options on top of BASE (both libraries get exactly these).
FAMILY_BASE = {
    "distill": {"max_completion_length": MAX_LEN},
    "gold": {"max_completion_length": MAX_LEN},
    "iw_opd": {"max_completion_length": MAX_LEN},
}

# name -> (family, data kind, overrides); "prompts": conversational prompts, "conversations": messages rows
CONFIGS: dict[str, tuple[str, str, dict]] = {
    "distill": ("distill", "prompts", {}),  # beta 1.0: reverse KL
    "distill_forward_kl": ("distill", "prompts", {"beta": 0.0}),
    "distill_jsd": ("distill", "prompts", {"beta": 0.5}),
    "distill_temperature": ("distill", "prompts", {"temperature": 0.7}),
    "gold_jsd": ("gold", "conversations", {"lmbda": 0.0}),  # beta 0.5, temperature 0.9
    "gold_forward_kl": ("gold", "conversations", {"lmbda": 0.0, "beta": 0.0}),
    "gold_reverse_kl": ("gold", "conversations", {"lmbda": 0.0, "beta": 1.0}),
    "gold_jsd_max_length": ("gold", "conversations", {"lmbda": 0.0, "max_length": 24}),  # rows are 25 to 43
    "gold_on_policy": ("gold", "conversations", {"lmbda": 1.0}),
    "gold_on_policy_forward_kl": ("gold", "conversations", {"lmbda": 1.0, "beta": 0.0}),
    "gold_on_policy_reverse_kl": ("gold", "conversations", {"lmbda": 1.0, "beta": 1.0}),
    "gold_on_policy_same_count": ("gold", "conversations", {"lmbda": 1.0, "max_completion_length": 16}),
    "gold_on_policy_forward_kl_same_count": (
        "gold",
        "conversations",
        {"lmbda": 1.0, "beta": 0.0, "max_completion_length": 16},
    ),
    "iw_opd": ("iw_opd", "conversations", {}),  # distillation_objective iw_opd, lmbda 1
    # a vision-language student (differential_vlm.py's tiny Qwen2-VL and LLaVA-NeXT, its prompts with
    # an image block and one image each) and a teacher of its family with perturbed weights
    "distill_vlm_qwen2_vl": ("distill", "vlm_qwen2_vl", {}),
    "distill_vlm_llava_next": ("distill", "vlm_llava_next", {}),
    "distill_vlm_qwen2_vl_jsd": ("distill", "vlm_qwen2_vl", {"beta": 0.5}),
    # the dataset's completions with their images (differential_offline_vlm's conversations)
    "gold_vlm_qwen2_vl_jsd": ("gold", "vlm_qwen2_vl_pc", {"lmbda": 0.0}),
    "gold_vlm_llava_next_jsd": ("gold", "vlm_llava_next_pc", {"lmbda": 0.0}),
    "iw_opd_gamma": ("iw_opd", "conversations", {"iw_opd_gamma": 2.0, "temperature": 0.7}),
    "iw_opd_same_count": ("iw_opd", "conversations", {"max_completion_length": 16}),
    "iw_opd_gamma_same_count": (
        "iw_opd",
        "conversations",
        {"max_completion_length": 16, "iw_opd_gamma": 2.0, "temperature": 0.7},
    ),
    "iw_opd_jsd": (
        "iw_opd",
        "conversations",
        {"distillation_objective": "jsd", "lmbda": 0.0},
    ),  # beta 1, top 1
    "iw_opd_jsd_top_1_beta_half": (
        "iw_opd",
        "conversations",
        {"distillation_objective": "jsd", "lmbda": 0.0, "beta": 0.5},
    ),
    "iw_opd_jsd_top_1_forward_kl": (
        "iw_opd",
        "conversations",
        {"distillation_objective": "jsd", "lmbda": 0.0, "beta": 0.0},
    ),
    "iw_opd_jsd_top_4_beta_half": (
        "iw_opd",
        "conversations",
        {"distillation_objective": "jsd", "lmbda": 0.0, "beta": 0.5, "loss_top_k": 4},
    ),
    "iw_opd_jsd_max_length": (
        "iw_opd",
        "conversations",
        {"distillation_objective": "jsd", "lmbda": 0.0, "max_length": 24},  # prompts 22 to 27, budget 16
    ),
    "iw_opd_jsd_full_vocab": (
        "iw_opd",
        "conversations",
        {"distillation_objective": "jsd", "lmbda": 0.0, "beta": 0.5, "loss_top_k": 0},
    ),
}
#: Scripted completions as long as the row's dataset completion: the reference divides an
#: on-policy step's loss by the dataset completions' token count (see the module docstring).
SAME_COUNT = "_same_count"


def dataset(kind: str):
    """The eight rows: conversational prompts (distillation), differential_vlm's prompts with an image
    each (``vlm_*``; ``vlm_*_pc``: differential_offline_vlm's prompt-completion rows with an image
    each), or offline's ``messages`` rows."""
    if kind.endswith("_pc"):
        from differential_offline_vlm import dataset as offline_vlm_dataset

        return offline_vlm_dataset("pc")
    if kind.startswith("vlm_"):
        from differential_vlm import dataset as vlm_dataset

        return vlm_dataset("blocks")
    if kind == "prompts":
        from datasets import Dataset

        return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS]})
    return data(kind)


def on_policy(name: str) -> bool:
    family, _, overrides = CONFIGS[name]
    return family == "distill" or overrides.get("lmbda", 1.0) == 1.0


class MixedScript(Script):
    """``Script`` whose completion kind (``rollout_plan``'s index) depends on the prompt too: each
    prompt is asked once per call here, and one batch should still mix every kind.

    With ``lengths`` (prompt text -> token count) each completion instead has that many tokens,
    the last one EOS (the other tokens still ``rollout_plan``'s, new at each call)."""

    def __init__(self, tok, lengths: dict[str, int] | None = None):
        super().__init__(tok)
        self.lengths = lengths

    def completions(self, prompts: list[list[int]]) -> list[list[int]]:
        eos, specials = self.tok.eos_token_id, set(self.tok.all_special_ids)
        out = []
        for ids in prompts:
            text = self.tok.decode(list(ids))
            if self.lengths is None:
                index = (sum(map(ord, text)) + self.calls) % 4
                out.append(rollout_plan(text, index, self.calls, len(self.tok), specials, eos)[0])
                continue
            body = []
            while len(body) < self.lengths[text] - 1:  # kind 1: MAX_LEN tokens, no EOS
                body += rollout_plan(text, 1, self.calls * 8 + len(body), len(self.tok), specials, eos)[0]
            out.append([*body[: self.lengths[text] - 1], eos])
        self.calls += 1
        return out


def dataset_lengths(tok) -> dict[str, int]:
    """Each ``messages`` row's prompt (rendered for generation) -> its dataset completion's token count
    (the chat template's tokens after the EOS included, as the reference's collators count them)."""
    out = {}
    for row in data("conversations")["messages"]:
        prompt = tok.apply_chat_template(row[:-1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(row, tokenize=False)
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        out[tok.decode(tok(prompt, add_special_tokens=False)["input_ids"])] = (
            len(tok(full, add_special_tokens=False)["input_ids"]) - n
        )
    return out


def script_trl(trainer, family: str, script: MixedScript) -> None:
    """Replace the reference's sampling by the script's completions."""
    from types import SimpleNamespace

    if family == "distill":
        trainer._generate_single_turn = lambda prompt_ids, images, multimodal_fields, has_tool_images=False: (
            script.completions(prompt_ids)
        )
        return
    generate = scripted_generate(script)
    trainer.model.generate = lambda **kwargs: SimpleNamespace(sequences=generate(**kwargs))


def run_child(lib: str, name: str, work: str, out_path: str) -> None:
    import importlib

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    family, kind, overrides = CONFIGS[name]
    ours, theirs = FAMILIES[family]
    if lib == "trl":
        module = importlib.import_module(theirs[0])
        config_class, trainer_class = getattr(module, theirs[1]), getattr(module, theirs[2])
    else:
        module = importlib.import_module("posttrain")
        config_class, trainer_class = getattr(module, ours[0]), getattr(module, ours[1])
    if kind.startswith("vlm_"):
        student, teacher, processing_class = vlm_models(work, vlm_family(kind))
        tok = processing_class.tokenizer
    else:
        paths = build_models(work)
        student, teacher = paths["lm"], paths["teacher"]
        tok = processing_class = AutoTokenizer.from_pretrained(paths["lm"])
    script = MixedScript(tok, dataset_lengths(tok) if name.endswith(SAME_COUNT) else None)
    result: dict = {"lib": lib, "config": name}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = config_class(output_dir=tmp, **{**BASE, **FAMILY_BASE[family], **overrides})
            trainer = trainer_class(
                model=student,
                teacher_model=teacher,
                args=args,
                train_dataset=dataset(kind),
                processing_class=processing_class,
            )
            if on_policy(name):
                (script_trl(trainer, family, script) if lib == "trl" else script_posttrain(trainer, script))
            trainer.train()
            for entry in trainer.state.log_history:  # the reference logs these two rounded to 4 decimals
                for key in ("on_policy_loss", "off_policy_loss"):
                    if key in entry:
                        entry[key] = round(entry[key], 4)
        except Exception as exc:  # noqa: BLE001 - recorded as "not accepted"
            record_failure(out_path, result, exc)
            return
        result["calls"] = script.calls
        record_run(out_path, result, trainer)


def vlm_family(kind: str) -> str:
    """The vision-language family of a ``vlm_*`` data kind."""
    return kind[len("vlm_") :].removesuffix("_pc")


def vlm_models(work: str, family: str):
    """The family's student (loaded from its folder, built by the parent), a teacher of the same
    weights perturbed by seeded noise, and the processor (``differential_vlm.load_processor``)."""
    import torch
    from differential_vlm import load_processor
    from transformers import AutoModelForImageTextToText

    path = os.path.join(work, family)
    student = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    teacher = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return student, teacher, load_processor(family, path)


def step_1_loss(res: dict) -> str:
    """Each side's first logged ``loss``."""
    values = []
    for lib in ("trl", "posttrain"):
        first = next((e for e in res[lib]["log_history"] if "loss" in e), {})
        values.append(f"{first['loss']:.6g}" if "loss" in first else "-")
    return " / ".join(values)


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    work = keep or tempfile.mkdtemp(prefix="differential-distill-")
    paths = build_models(work)
    inits = {"lm": os.path.join(work, "init-lm.pt")}
    m = AutoModelForCausalLM.from_pretrained(paths["lm"], dtype=torch.float32)
    torch.save({k: v.detach().float() for k, v in m.state_dict().items()}, inits["lm"])
    for kind in dict.fromkeys(CONFIGS[n][1] for n in names if CONFIGS[n][1].startswith("vlm_")):
        from differential_vlm import prepare_family

        inits[kind] = prepare_family(work, vlm_family(kind))[1]
    script = os.path.abspath(__file__)

    return drive(
        names,
        work,
        lambda lib, name, out: [script, "--lib", lib, "--config", name, "--work", work, "--out", out],
        lambda name: inits.get(CONFIGS[name][1], inits["lm"]),
        generation_calls_note,
        verbose,
        column=("step-1 loss trl / posttrain", step_1_loss),
    )


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent, "work")


if __name__ == "__main__":
    sys.exit(main())
