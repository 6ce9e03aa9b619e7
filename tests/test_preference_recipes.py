"""The KTO, ORPO, CPO, reward-model, RLOO and A*-PO paper recipes in ``recipes/{kto,orpo,cpo,reward,rloo,a2po}/``.

One recipe per config example of those sections of the paper index. A recipe is a YAML mapping
of its family's config fields, loaded with ``yaml.safe_load`` and passed as
``<Family>Config(output_dir=..., **values)`` or as ``posttrain <family> --config RECIPE.yaml``.
The file checks are strict (every key a field, every value line commented, the header naming
the paper and the index lines); the values must be the index's. KTO's index example is
``KTOConfig()`` with no arguments: its recipe writes defaults out, and each must be the
config's own default. The training test shrinks each recipe to a two-step CPU run on a tiny
model with the overrides of ``TINY_RUN`` (``TINY_ONLINE_RUN`` for RLOO and A*-PO, which sample
their own completions of prompts and score them with a reward function).

``test_the_index_gives_these_examples`` reads the paper index itself (the Portuguese
``paper-index.pt.txt``; ``POSTTRAIN_PAPER_INDEX`` or the shared spec folder) and checks the
headings, arXiv ids and config calls recorded here against it; it is skipped where the index is
not present.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import yaml
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset

from posttrain import (
    A2POConfig,
    A2POTrainer,
    CPOConfig,
    CPOTrainer,
    KTOConfig,
    KTOTrainer,
    ORPOConfig,
    ORPOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
)
from posttrain.cli import a2po as a2po_cli
from posttrain.cli import cpo as cpo_cli
from posttrain.cli import kto as kto_cli
from posttrain.cli import orpo as orpo_cli
from posttrain.cli import reward as reward_cli
from posttrain.cli import rloo as rloo_cli
from posttrain.cli.online import OnlineScriptArguments
from posttrain.cli.options import parse_config
from posttrain.cli.training import PairTaskScriptArguments

RECIPES_ROOT = Path(__file__).resolve().parent.parent / "recipes"
INDEX_PATH = Path(os.environ.get("POSTTRAIN_PAPER_INDEX", "/work/shared/spec/paper-index.pt.txt"))


class Family(NamedTuple):
    """A trainer family: its config, its trainer, its command's module and script arguments."""

    config: type
    trainer: type
    cli: Any
    script_args: type


FAMILIES: dict[str, Family] = {
    "kto": Family(KTOConfig, KTOTrainer, kto_cli, PairTaskScriptArguments),
    "orpo": Family(ORPOConfig, ORPOTrainer, orpo_cli, PairTaskScriptArguments),
    "cpo": Family(CPOConfig, CPOTrainer, cpo_cli, PairTaskScriptArguments),
    "reward": Family(RewardConfig, RewardTrainer, reward_cli, reward_cli.RewardScriptArguments),
    "rloo": Family(RLOOConfig, RLOOTrainer, rloo_cli, OnlineScriptArguments),
    "a2po": Family(A2POConfig, A2POTrainer, a2po_cli, OnlineScriptArguments),
}


class Paper(NamedTuple):
    """One config example of the paper index and the recipe that reproduces it.

    Attributes:
        title: the paper's full (English) title; the recipe's header names it.
        arxiv: the arXiv id; the header names it, the index links ``papers/<arxiv>``.
        heading: the index's (Portuguese) heading of the paper's entry.
        heading_line: the heading's line in the index (the link is two lines below).
        lines: first and last line of the call that holds the config in the index.
        index_values: the keyword arguments of the ``<Family>Config(...)`` call.
        stated_defaults: recipe keys the index leaves to the config's defaults (``KTOConfig()``);
            the recipe must hold the config's default for each.
    """

    title: str
    arxiv: str
    heading: str
    heading_line: int
    lines: tuple[int, int]
    index_values: dict[str, Any]
    stated_defaults: tuple[str, ...] = ()


# Keyed by "<family>/<recipe name>".
PAPERS: dict[str, Paper] = {
    "kto/kto": Paper(
        "KTO: Model Alignment as Prospect Theoretic Optimization",
        "2402.01306",
        "KTO: Alinhamento de modelos como otimização prospectiva",
        1006,
        (1018, 1023),
        {},
        stated_defaults=("loss_type", "beta", "desirable_weight", "undesirable_weight", "learning_rate"),
    ),
    "orpo/orpo": Paper(
        "ORPO: Monolithic Preference Optimization without Reference Model",
        "2403.07691",
        "ORPO: Otimização de Preferência Monolítica sem Modelo de Referência",
        1196,
        (1204, 1211),
        {
            "beta": 0.1,
            "learning_rate": 5e-6,
            "lr_scheduler_type": "inverse_sqrt",
            "num_train_epochs": 5,
            "warmup_steps": 200,
            "per_device_train_batch_size": 8,
        },
    ),
    "cpo/cpo": Paper(
        "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine Translation",
        "2401.08417",
        "Contrastive Preference Optimization: Expandindo os limites do desempenho de LLMs na tradução automática",
        1217,
        (1225, 1234),
        {
            "loss_type": "sigmoid",
            "cpo_alpha": 1.0,
            "beta": 0.1,
            "learning_rate": 1e-4,
            "lr_scheduler_type": "inverse_sqrt",
            "num_train_epochs": 1,
            "warmup_ratio": 0.01,
            "max_length": 512,
        },
    ),
    "cpo/simpo": Paper(
        "SimPO: Simple Preference Optimization with a Reference-Free Reward",
        "2405.14734",
        "SimPO: Otimização de Preferência Simples com Recompensa Sem Referência",
        1236,
        (1244, 1251),
        {
            "loss_type": "simpo",
            "cpo_alpha": 0.0,
            "beta": 2.5,
            "simpo_gamma": 1.375,
            "learning_rate": 1e-6,
            "num_train_epochs": 1,
        },
    ),
    "cpo/alphapo": Paper(
        "AlphaPO: Reward Shape Matters for LLM Alignment",
        "2501.03884",
        "AlphaPO — A forma da recompensa importa para o alinhamento de LLM",
        1253,
        (1262, 1269),
        {"loss_type": "alphapo", "alpha": 0.25, "beta": 2.5, "simpo_gamma": 0.1, "learning_rate": 7e-7},
    ),
    "reward/center_rewards": Paper(
        "Helping or Herding? Reward Model Ensembles Mitigate but do not Eliminate Reward Hacking",
        "2312.09244",
        "Ajudar ou seguir o rebanho? Ensambles de modelos de recompensa mitigam, mas não eliminam, o hacking "
        "de recompensa",
        1291,
        (1301, 1304),
        {"center_rewards_coefficient": 0.01},
    ),
    "rloo/rloo": Paper(
        "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs",
        "2402.14740",
        "Voltando ao básico: Revisitando a otimização no estilo REINFORCE para aprendizado com feedback humano "
        "em LLMs",
        1164,
        (1172, 1178),
        {
            "per_device_train_batch_size": 512,
            "steps_per_generation": 2,
            "beta": 0.03,
            "num_generations": 2,
            "learning_rate": 1e-6,
        },
    ),
    "rloo/reinforce_pp": Paper(
        "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
        "2501.03262",
        "REINFORCE++: Uma abordagem simples e eficiente para alinhar grandes modelos de linguagem",
        1180,
        (1188, 1190),
        {"normalize_advantages": True},
    ),
    "a2po/a2po": Paper(
        "Accelerating RL for LLM Reasoning with Optimal Advantage Regression",
        "2505.20686",
        "Acelerando RL para Raciocínio de LLMs com Regressão de Vantagem Ótima",
        583,
        (592, 596),
        {"beta1": 0.5, "beta2": 1e-3, "num_value_samples": 8},
    ),
}

# The index's margin example (Llama 2): data, not a config; the reward recipe's header describes it.
MARGIN_EXAMPLE = {
    "title": "Llama 2: Open Foundation and Fine-Tuned Chat Models",
    "arxiv": "2307.09288",
    "heading_line": 1306,
    "lines": (1314, 1323),
    "margins": {
        "significantly better": 1.0,
        "better": 2.0 / 3.0,
        "slightly better": 1.0 / 3.0,
        "negligibly better / unsure": 0.0,
    },
}

# Overrides that turn a recipe into a two-step CPU run on the tiny model (they win over the
# recipe's); the recipes' batch fields describe the papers' multi-GPU jobs.
TINY_RUN: dict[str, Any] = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "max_steps": 2,
    "max_length": 64,
    # CPU, float32, nothing written or reported, a log line (with its loss) every step.
    "bf16": False,
    "use_cpu": True,
    "report_to": "none",
    "save_strategy": "no",
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "disable_tqdm": True,
}

# The same for RLOO: prompts of up to 8 sampled tokens, two completions each, a token-sum reward.
TINY_ONLINE_RUN: dict[str, Any] = {
    **{k: v for k, v in TINY_RUN.items() if k != "max_length"},
    "num_generations": 2,
    "max_completion_length": 8,
    "learning_rate": 1e-2,
}

_KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:")
_NUMBER_LIKE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

RECIPES = sorted(f"{p.parent.name}/{p.stem}" for f in FAMILIES for p in (RECIPES_ROOT / f).glob("*.yaml"))


def _family(name: str) -> Family:
    return FAMILIES[name.split("/")[0]]


def _path(name: str) -> Path:
    return RECIPES_ROOT / f"{name}.yaml"


def _load(name: str) -> dict[str, Any]:
    with open(_path(name)) as f:
        return yaml.safe_load(f)


def _header(name: str) -> str:
    """The comment block at the top of a recipe, before its first key, as one line."""
    lines = []
    for line in _path(name).read_text().splitlines():
        if line.startswith("#"):
            lines.append(line.lstrip("#").strip())
        elif line.strip():
            break
    return " ".join(lines)


def _fields(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(_family(name).config)}


def _expected_values(name: str, tmp_path: Path) -> dict[str, Any]:
    """What the recipe must hold: the index's values, and the config's defaults it states."""
    paper = PAPERS[name]
    defaults = _family(name).config(output_dir=str(tmp_path))
    return {**{k: getattr(defaults, k) for k in paper.stated_defaults}, **paper.index_values}


def preference_pairs(n: int = 8, margin: bool = False) -> Dataset:
    """Prompt/chosen/rejected strings; with ``margin``, Llama 2's "Margin Small" margins."""
    rows: dict[str, list[Any]] = {
        "prompt": [f"What is {i} plus {i}?" for i in range(n)],
        "chosen": [f" <answer>{2 * i}</answer>" for i in range(n)],
        "rejected": [f" {2 * i + 1}" + " and one more" * (i % 3) for i in range(n)],
    }
    if margin:
        labels = list(MARGIN_EXAMPLE["margins"])
        rows["preference_label"] = [labels[i % len(labels)] for i in range(n)]
    data = Dataset.from_dict(rows)
    if margin:  # the index's add_margin (lines 1314-1323)
        data = data.map(lambda ex: {"margin": MARGIN_EXAMPLE["margins"][ex["preference_label"]]})
    return data


def _token_sum_reward(completion_ids, **kwargs):
    """Varies between completions even when all reach the length limit (the tiny model rarely ends)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def _odd_sum_reward(completion_ids, **kwargs):
    """Binary (A*-PO needs it) and different between completions."""
    return [float(sum(ids) % 2) for ids in completion_ids]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Skip the PNG curves written at the end of training (about 2 s of matplotlib per run)."""
    monkeypatch.setattr("posttrain.core.trainer.BaseTrainer._write_plots", lambda self: None)


def test_one_recipe_per_index_example():
    assert RECIPES == sorted(PAPERS)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_file_is_well_formed(name):
    path = _path(name)
    values = _load(name)
    assert isinstance(values, dict) and values, f"{path} must hold a non-empty mapping"

    unknown = sorted(set(values) - _fields(name))
    assert not unknown, f"{path}: keys that are not {_family(name).config.__name__} fields: {unknown}"

    # YAML 1.1 reads `1e-6` (no dot) as a string: every number must parse as a number.
    for key, value in values.items():
        assert not (isinstance(value, str) and _NUMBER_LIKE.fullmatch(value)), (
            f"{path}: {key}={value!r} parsed as a string; write it with a dot, e.g. 1.0e-6"
        )

    # every value line cites its source in a comment, with the index line
    for line in path.read_text().splitlines():
        match = _KEY_LINE.match(line)
        if match:
            assert " # " in line and "paper index l." in line, (
                f"{path}: the line of {match.group(1)!r} does not cite its source"
            )

    paper = PAPERS[name]
    header = _header(name)
    start, end = paper.lines
    for needle in (
        paper.title,
        f"arXiv: {paper.arxiv}",
        f"{start}-{end}",
        f"heading at line {paper.heading_line}",
    ):
        assert needle in header, f"{path}: the header does not name {needle!r}"


def test_the_reward_recipe_describes_the_margin_example():
    header = _header("reward/center_rewards")
    start, end = MARGIN_EXAMPLE["lines"]
    for needle in (
        MARGIN_EXAMPLE["title"],
        f"arXiv: {MARGIN_EXAMPLE['arxiv']}",
        f"{start}-{end}",
        f"heading at line {MARGIN_EXAMPLE['heading_line']}",
        "margin",
        *MARGIN_EXAMPLE["margins"],
    ):
        assert needle in header, f"the reward recipe's header does not name {needle!r}"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_values_are_the_index_values(name, tmp_path):
    """The recipe holds exactly the index's values (KTO: the KTOConfig() defaults it writes out)."""
    assert _load(name) == _expected_values(name, tmp_path)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_its_config(name, tmp_path):
    values = _load(name)
    config = _family(name).config(output_dir=str(tmp_path), **values)
    for key, value in values.items():
        assert getattr(config, key) == value, key


def test_the_index_configs_run_as_written(tmp_path):
    """CPO's warmup_ratio (removed from transformers 5; TypeError on the reference) is passed on as
    a fractional warmup_steps; AlphaPO's cpo_alpha resolves to 0 without being given."""
    config = CPOConfig(output_dir=str(tmp_path), **PAPERS["cpo/cpo"].index_values)
    assert config.warmup_steps == 0.01 and config.get_warmup_steps(1000) == 10
    alphapo = CPOConfig(output_dir=str(tmp_path), **PAPERS["cpo/alphapo"].index_values)
    assert alphapo.loss_type == "alphapo" and alphapo.cpo_alpha == 0.0
    kto = KTOConfig(output_dir=str(tmp_path))
    assert kto.loss_type == "kto" and kto.beta == 0.1


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_two_steps(name, tok, tmp_path):
    family = _family(name)
    values = _load(name)
    model = build_tiny_model(tok)
    if family.trainer is RewardTrainer:  # a one-label sequence classifier on the tiny decoder
        from transformers import LlamaForSequenceClassification

        config = model.config
        config.num_labels, config.pad_token_id = 1, tok.pad_token_id
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(config)
    before = [p.detach().clone() for p in model.parameters()]
    if family.trainer is RLOOTrainer:
        args = family.config(**{**values, **TINY_ONLINE_RUN, "output_dir": str(tmp_path)})
        prompts = Dataset.from_dict({"prompt": [f"What is {i} plus {i}?" for i in range(8)]})
        trainer = RLOOTrainer(
            model, _token_sum_reward, args=args, train_dataset=prompts, processing_class=tok
        )
    elif family.trainer is A2POTrainer:  # one completion per prompt; a binary reward
        tiny = {k: v for k, v in TINY_ONLINE_RUN.items() if k != "num_generations"}
        args = family.config(**{**values, **tiny, "output_dir": str(tmp_path), "num_value_samples": 2})
        prompts = Dataset.from_dict({"prompt": [f"What is {i} plus {i}?" for i in range(8)]})
        trainer = A2POTrainer(model, _odd_sum_reward, args=args, train_dataset=prompts, processing_class=tok)
    else:
        args = family.config(**{**values, **TINY_RUN, "output_dir": str(tmp_path)})
        data = preference_pairs(margin=family.trainer is RewardTrainer)
        trainer = family.trainer(model, args=args, train_dataset=data, processing_class=tok)
    trainer.train()

    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses), losses


# ---- posttrain <family> --config recipes/<family>/<name>.yaml -----------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_read_by_the_cli(name, tmp_path):
    """``posttrain <family> --config`` takes every recipe; the recipe's values win over the CLI's defaults."""
    family = _family(name)
    _, config = parse_config(
        ["--config", str(_path(name)), "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"],
        family.script_args,
        family.config,
        command=name.split("/")[0],
        summary="A recipe.",
        defaults=family.cli.LAPTOP_DEFAULTS,
    )
    assert isinstance(config, family.config)
    for key, value in _load(name).items():
        assert getattr(config, key) == value, key


def test_cli_trains_a_recipe(tmp_path, tiny_model_dir):
    """``posttrain cpo --config recipes/cpo/cpo.yaml`` (warmup_ratio as written) on the tiny model."""
    data = tmp_path / "pairs.jsonl"
    preference_pairs().to_json(str(data), lines=True)
    out = tmp_path / "run"
    trainer = cpo_cli.cpo(
        ["--config", str(_path("cpo/cpo")), "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data),
         "--output_dir", str(out), "--use_cpu", "--bf16", "false", "--max_steps", "2",
         "--per_device_train_batch_size", "4", "--max_length", "64", "--report_to", "none",
         "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]
    )  # fmt: skip
    assert trainer.state.global_step == 2
    args = trainer.args
    assert args.loss_type == "sigmoid" and args.cpo_alpha == 1.0 and args.learning_rate == 1e-4
    assert (
        args.warmup_ratio == 0.01 and args.warmup_steps == 0.01 and args.lr_scheduler_type == "inverse_sqrt"
    )
    # a flag wins over the recipe (max_length 512) and over the command's default (batch 8)
    assert args.max_length == 64 and args.per_device_train_batch_size == 4
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(loss) for loss in losses)


# ---- the paper index itself -----------------------------------------------------------------------


def _config_call(lines: list[str], start: int, end: int, config_name: str) -> dict[str, Any]:
    """The keyword arguments of the one ``<config_name>(...)`` call on index lines ``start``-``end``.

    A line that is only ``...`` (the index's "and the rest") is left out before parsing.
    """
    block = lines[start - 1 : end]
    assert "(" in block[0] and block[-1].strip() == ")", (
        f"index lines {start}-{end} are not one call:\n" + "\n".join(block)
    )
    text = "\n".join(line for line in block if line.strip() not in ("...", "...,"))
    calls = [
        node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == config_name
    ]
    assert len(calls) == 1 and not calls[0].args, f"no single {config_name}(...) call on lines {start}-{end}"
    return {kw.arg: ast.literal_eval(kw.value) for kw in calls[0].keywords}


def _literal(node: ast.expr) -> Any:
    """A literal of the index, or a quotient of two (the margin example's ``2.0/3.0``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _literal(node.left) / _literal(node.right)
    return ast.literal_eval(node)


def _index_lines() -> list[str]:
    return INDEX_PATH.read_text(encoding="utf-8").splitlines()


@pytest.mark.skipif(not INDEX_PATH.is_file(), reason=f"the paper index is not at {INDEX_PATH}")
@pytest.mark.parametrize("name", RECIPES)
def test_the_index_gives_these_examples(name):
    """The heading, arXiv link and config call recorded in ``PAPERS`` are the index's."""
    lines = _index_lines()
    paper = PAPERS[name]
    assert lines[paper.heading_line - 1].strip() == paper.heading
    assert f"papers/{paper.arxiv}" in lines[paper.heading_line + 1]
    start, end = paper.lines
    assert paper.heading_line < start
    # no other paper's entry between the heading and the call
    assert not any("papers/" in line for line in lines[paper.heading_line + 2 : start - 1])
    config_name = _family(name).config.__name__
    assert _config_call(lines, start, end, config_name) == paper.index_values
    # every value line of the recipe cites the index line that gives it
    for line in _path(name).read_text().splitlines():
        match = _KEY_LINE.match(line)
        if match and paper.index_values:
            cited = int(re.search(r"paper index l\.(\d+)", line).group(1))
            assert lines[cited - 1].strip().startswith(f"{match.group(1)}="), (name, match.group(1), cited)
        elif match:  # KTOConfig(): every stated default cites the KTOConfig() line
            cited = int(re.search(r"paper index l\.(\d+)", line).group(1))
            assert f"{config_name}()" in lines[cited - 1], (name, cited)


@pytest.mark.skipif(not INDEX_PATH.is_file(), reason=f"the paper index is not at {INDEX_PATH}")
def test_the_index_gives_the_margin_example():
    lines = _index_lines()
    heading = MARGIN_EXAMPLE["heading_line"]
    assert lines[heading - 1].strip().startswith("Llama 2")
    assert f"papers/{MARGIN_EXAMPLE['arxiv']}" in lines[heading + 1]
    start, end = MARGIN_EXAMPLE["lines"]
    text = "\n".join(lines[start - 1 : end])
    assert (
        lines[start - 1].startswith("def add_margin")
        and lines[end - 1].strip() == "dataset = dataset.map(add_margin)"
    )
    function = ast.parse(text).body[0]
    mapping = next(node for node in ast.walk(function) if isinstance(node, ast.Dict))
    keys = [ast.literal_eval(k) for k in mapping.keys]
    values = [_literal(v) for v in mapping.values]
    assert dict(zip(keys, values, strict=True)) == MARGIN_EXAMPLE["margins"]
