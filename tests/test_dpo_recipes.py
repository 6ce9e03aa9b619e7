"""The DPO paper recipes in ``recipes/dpo/``: one per ``DPOConfig`` example of the paper index.

A recipe is a YAML mapping of DPOConfig fields, loaded with ``yaml.safe_load`` and passed as
``DPOConfig(output_dir=..., **values)`` or as ``posttrain dpo --config RECIPE.yaml``. The file
checks are strict (every key a field, every value line commented, the header naming the paper
and the index lines); the values must be the index's, except for the departures listed in
``PAPERS`` (index examples that do not run as written); the training test shrinks each recipe to
a two-step CPU run with the overrides of ``TINY_RUN``.

``test_the_index_gives_these_examples`` reads the paper index itself (the Portuguese
``paper-index.pt.txt``; ``POSTTRAIN_PAPER_INDEX`` or the shared spec folder) and checks the
headings, arXiv ids and ``DPOConfig(...)`` blocks recorded here against it; it is skipped where
the index is not present.
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

from posttrain import DPOConfig, DPOTrainer
from posttrain.cli import dpo as dpo_cli
from posttrain.cli.options import parse_config
from posttrain.cli.training import PairTaskScriptArguments

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes" / "dpo"
INDEX_PATH = Path(os.environ.get("POSTTRAIN_PAPER_INDEX", "/work/shared/spec/paper-index.pt.txt"))


class Paper(NamedTuple):
    """One DPOConfig example of the paper index and the recipe that reproduces it.

    Attributes:
        title: the paper's full (English) title; the recipe's header names it.
        arxiv: the arXiv id; the header names it, the index links ``papers/<arxiv>``.
        heading: the index's (Portuguese) heading of the paper's entry.
        heading_line: the heading's line in the index (the link is two lines below).
        lines: first and last line of the ``DPOConfig(...)`` call in the index.
        index_values: the keyword arguments of that call.
        added: recipe values the index does not give (it does not run without them).
        replaced: index keys the recipe writes differently, mapped to the recipe's key.
    """

    title: str
    arxiv: str
    heading: str
    heading_line: int
    lines: tuple[int, int]
    index_values: dict[str, Any]
    added: dict[str, Any] = {}
    replaced: dict[str, str] = {}


PAPERS: dict[str, Paper] = {
    "dpo": Paper(
        "Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
        "2305.18290",
        "Otimização de Preferência Direta: Seu Modelo de Linguagem é Secretamente um Modelo de Recompensa",
        609,
        (617, 622),
        {"loss_type": "sigmoid", "per_device_train_batch_size": 64, "learning_rate": 1e-6, "beta": 0.1},
    ),
    "slic_hinge": Paper(
        "SLiC-HF: Sequence Likelihood Calibration with Human Feedback",
        "2305.10425",
        "SLiC-HF: Calibração de verossimilhança de sequência com feedback humano",
        624,
        (632, 636),
        {"loss_type": "hinge", "per_device_train_batch_size": 512, "learning_rate": 1e-4},
    ),
    "rso": Paper(
        "Statistical Rejection Sampling Improves Preference Optimization",
        "2309.06657",
        "Amostragem de Rejeição Estatística Melhora a Otimização de Preferência",
        640,
        (657, 660),
        {"loss_type": "hinge", "beta": 0.05},
    ),
    "f_dpo_js": Paper(
        "Beyond Reverse KL: Generalizing Direct Preference Optimization with Diverse Divergence Constraints",
        "2309.16240",
        "Além do KL reverso: Generalizando a Otimização de Preferência Direta com Restrições de "
        "Divergência Diversas",
        669,
        (681, 686),
        {
            "loss_type": "sigmoid",
            "beta": 0.1,
            "f_divergence_type": "js_divergence",
            "f_alpha_divergence_coef": 0.5,
        },
    ),
    "ipo": Paper(
        "A General Theoretical Paradigm to Understand Learning from Human Preferences",
        "2310.12036",
        "Um paradigma teórico geral para entender o aprendizado a partir de preferências humanas",
        688,
        (698, 702),
        {"loss_type": "ipo", "per_device_train_batch_size": 90, "learning_rate": 1e-2},
    ),
    "exo": Paper(
        "Towards Efficient Exact Optimization of Language Model Alignment",
        "2402.00856",
        "Em direção à otimização eficiente e exata do alinhamento de modelos de linguagem",
        706,
        (714, 720),
        {"loss_type": "exo_pair", "per_device_train_batch_size": 64, "learning_rate": 1e-6, "beta": 0.1},
        # exo_pair needs label_smoothing in (0, 1); the EXO paper's eps for its pairwise loss.
        added={"label_smoothing": 1e-3},
    ),
    "nca": Paper(
        "Noise Contrastive Alignment of Language Models with Explicit Rewards",
        "2402.05369",
        "Alinhamento Contrastivo de Ruído de Modelos de Linguagem com Recompensas Explícitas",
        722,
        (734, 740),
        {"loss_type": "nca_pair", "per_device_train_batch_size": 32, "learning_rate": 5e-6, "beta": 0.01},
    ),
    "robust_dpo": Paper(
        "Provably Robust DPO: Aligning Language Models with Noisy Feedback",
        "2403.00409",
        "DPO Robusto Provávelmente: Alinhando Modelos de Linguagem com Feedback Ruidoso",
        742,
        (754, 761),
        {
            "loss_type": "robust",
            "per_device_train_batch_size": 16,
            "learning_rate": 1e-3,
            "beta": 0.1,
            "max_length": 512,
            "label_smoothing": 0.1,
        },
    ),
    "bco": Paper(
        "Binary Classifier Optimization for Large Language Model Alignment",
        "2404.04656",
        "Otimização de Classificador Binário para Alinhamento de Modelos de Linguagem de Grande Escala",
        763,
        (777, 783),
        {"loss_type": "bco_pair", "per_device_train_batch_size": 128, "learning_rate": 5e-7, "beta": 0.01},
    ),
    "tr_dpo": Paper(
        "Learn Your Reference Model for Real Good Alignment",
        "2404.09656",
        "Aprenda seu modelo de referência para um alinhamento de verdade",
        785,
        (793, 803),
        {
            "sync_ref_model": True,
            "ref_model_mixup_alpha": 0.6,
            "ref_model_sync_steps": 512,
            "beta": 0.05,
            "learning_rate": 1e-6,
            "num_train_epochs": 1,
            "max_length": 1024,
            "max_grad_norm": 2,
            "warmup_steps": 100,
        },
    ),
    "iterative_rpo": Paper(
        "Iterative Reasoning Preference Optimization",
        "2404.19733",
        "Otimização de Preferência de Raciocínio Iterativo",
        805,
        (815, 818),
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]},
    ),
    "sppo_hard": Paper(
        "Self-Play Preference Optimization for Language Model Alignment",
        "2405.00675",
        "Otimização de Preferências por Auto-Jogo para Alinhamento de Modelos de Linguagem",
        826,
        (834, 840),
        {"loss_type": "sppo_hard", "beta": 0.001, "per_device_train_batch_size": 64, "learning_rate": 5e-7},
    ),
    "regularized_rpo": Paper(
        "Provably Mitigating Overoptimization in RLHF: Your SFT Loss is Implicitly an Adversarial Regularizer",
        "2405.16436",
        "Mitigação comprovada da sobreotimização em RLHF: sua perda de SFT é implicitamente um "
        "regularizador adversarial",
        842,
        (850, 856),
        {
            "loss_type": ["sigmoid", "sft"],
            "loss_weights": [1.0, 0.005],
            "beta": 0.01,
            "learning_rate": 5e-7,
            "num_train_epochs": 1,
        },
    ),
    "aot": Paper(
        "Distributional Preference Alignment of LLMs via Optimal Transport",
        "2406.05882",
        "Alinhamento de Preferências Distribucionais de LLMs por Transporte Ótimo",
        858,
        (866, 869),
        {"loss_type": "aot", "beta": 0.01},
    ),
    "aot_unpaired": Paper(
        "Distributional Preference Alignment of LLMs via Optimal Transport",
        "2406.05882",
        "Alinhamento de Preferências Distribucionais de LLMs por Transporte Ótimo",
        858,
        (875, 878),
        {"loss_type": "aot_unpaired", "beta": 0.01},
    ),
    "discopop": Paper(
        "Discovering Preference Optimization Algorithms with and for Large Language Models",
        "2406.08414",
        "Descobrindo Algoritmos de Otimização de Preferências com e para Modelos de Linguagem de Grande Escala",
        882,
        (890, 896),
        {
            "loss_type": "discopop",
            "per_device_train_batch_size": 64,
            "learning_rate": 5e-7,
            "beta": 0.05,
            "discopop_tau": 0.05,
        },
    ),
    "wpo": Paper(
        "WPO: Enhancing RLHF with Weighted Preference Optimization",
        "2406.11827",
        "WPO: Aprimorando o RLHF com Otimização de Preferência Ponderada",
        898,
        (910, 914),
        {"loss_type": "sigmoid", "beta": 0.01, "use_weighting": True},
    ),
    "apo_zero": Paper(
        "Anchored Preference Optimization and Contrastive Revisions: Addressing Underspecification in Alignment",
        "2408.06266",
        "Otimização de Preferências Ancoradas e Revisões Contrastivas: Abordando a Subespecificação no Alinhamento",
        916,
        (924, 929),
        {"loss_type": "apo_zero", "per_device_train_batch_size": 64, "learning_rate": 2e-7, "beta": 0.1},
    ),
    "apo_down": Paper(
        "Anchored Preference Optimization and Contrastive Revisions: Addressing Underspecification in Alignment",
        "2408.06266",
        "Otimização de Preferências Ancoradas e Revisões Contrastivas: Abordando a Subespecificação no Alinhamento",
        916,
        (932, 937),
        {"loss_type": "apo_down", "per_device_train_batch_size": 64, "learning_rate": 2e-7, "beta": 0.1},
    ),
    "ld_dpo": Paper(
        "Length Desensitization in Direct Preference Optimization",
        "2409.06411",
        "Desensibilização ao comprimento na Otimização de Preferência Direta",
        941,
        (951, 953),
        {"ld_alpha": 0.5},
    ),
    "mpo": Paper(
        "Enhancing the Reasoning Ability of Multimodal Large Language Models via Mixed Preference Optimization",
        "2411.10442",
        "Melhorando a capacidade de raciocínio de modelos de linguagem grandes multimodais por meio de "
        "otimização de preferências mistas",
        955,
        (963, 967),
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0], "learning_rate": 5e-6},
    ),
    "sigmoid_norm": Paper(
        "Tulu 3: Pushing Frontiers in Open Language Model Post-Training",
        "2411.15124",
        "TÜLU 3: Avançando as fronteiras no pós-treino de modelos de linguagem abertos",
        969,
        (977, 979),
        {"loss_type": "sigmoid_norm"},
    ),
    "udpo": Paper(
        "Unbiased Alignment for Large Language Models with Noisy Preferences",
        "2607.03248",
        "Alinhamento sem viés para modelos de linguagem de grande escala com preferências ruidosas",
        981,
        (991, 1000),
        {
            "loss_type": "udpo",
            "label_smoothing": 4 / 9,
            "beta": 0.1,
            "learning_rate": 5e-6,
            "num_train_epochs": 3,
            "per_device_train_batch_size": 16,
            "max_grad_norm": 10.0,
            "warmup_ratio": 0.1,
        },
    ),
}

# Overrides that shrink any recipe to a two-step CPU run on the tiny model (each value wins over
# the recipe's); the recipes' batch fields describe the papers' multi-GPU jobs.
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
# Per-recipe additions to TINY_RUN: TR-DPO syncs its reference every 512 steps, never within two;
# syncing every step makes the tiny run exercise the reference update.
TINY_EXTRA: dict[str, dict[str, Any]] = {"tr_dpo": {"ref_model_sync_steps": 1}}

_KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:")
_NUMBER_LIKE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
DPO_FIELDS = {f.name for f in dataclasses.fields(DPOConfig)}


def _path(name: str) -> Path:
    return RECIPES_DIR / f"{name}.yaml"


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


def _expected_values(paper: Paper) -> dict[str, Any]:
    """The index's values with the paper's departures applied: what the recipe must hold."""
    expected = {paper.replaced.get(k, k): v for k, v in paper.index_values.items()}
    expected.update(paper.added)
    return expected


def _as_config_value(key: str, value: Any) -> Any:
    """``value`` as DPOConfig holds it (a single loss type becomes a one-item list)."""
    if key == "loss_type" and isinstance(value, str):
        return [value]
    return value


def preference_pairs(n: int = 8) -> Dataset:
    """Prompt/chosen/rejected strings; the completions differ in length (LD-DPO, WPO, *_norm)."""
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(n)],
            "chosen": [f" <answer>{2 * i}</answer>" for i in range(n)],
            "rejected": [f" {2 * i + 1}" + " and one more" * (i % 3) for i in range(n)],
        }
    )


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture
def no_plots(monkeypatch):
    """Skip the PNG curves written at the end of training (about 2 s of matplotlib per run)."""
    monkeypatch.setattr(DPOTrainer, "_write_plots", lambda self: None)


def test_one_recipe_per_index_example():
    assert RECIPES == sorted(PAPERS)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_file_is_well_formed(name):
    path = _path(name)
    values = _load(name)
    assert isinstance(values, dict) and values, f"{path} must hold a non-empty mapping"

    unknown = sorted(set(values) - DPO_FIELDS)
    assert not unknown, f"{path}: keys that are not DPOConfig fields: {unknown}"

    # YAML 1.1 reads `1e-6` (no dot) as a string: every number must parse as a number.
    for key, value in values.items():
        assert not (isinstance(value, str) and _NUMBER_LIKE.fullmatch(value)), (
            f"{path}: {key}={value!r} parsed as a string; write it with a dot, e.g. 1.0e-6"
        )

    # every value line cites its source in a comment
    for line in path.read_text().splitlines():
        match = _KEY_LINE.match(line)
        if match:
            assert " # " in line, f"{path}: the line of {match.group(1)!r} has no source comment"

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
    # a departure from the index is said in the header, next to the key it concerns
    for key in [*paper.added, *paper.replaced, *paper.replaced.values()]:
        assert "Departure from the index" in header and key in header, (
            f"{path}: the header must explain the departure on {key!r}"
        )


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_values_are_the_index_values(name):
    """The recipe holds exactly the index's DPOConfig values, plus the listed departures."""
    assert _load(name) == _expected_values(PAPERS[name])


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_a_dpo_config(name, tmp_path):
    values = _load(name)
    config = DPOConfig(output_dir=str(tmp_path), **values)
    for key, value in values.items():
        assert getattr(config, key) == _as_config_value(key, value), key


def test_the_index_examples_do_not_all_run_as_written(tmp_path):
    """EXO's departure is needed (its index config fails); UDPO's warmup_ratio runs as written here
    (the reference raises TypeError on it: transformers 5 removed the field)."""
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(output_dir=str(tmp_path), **PAPERS["exo"].index_values)
    config = DPOConfig(output_dir=str(tmp_path), **PAPERS["udpo"].index_values)
    assert config.warmup_steps == 0.1 and config.get_warmup_steps(1000) == 100


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_two_steps(name, tok, tmp_path, no_plots):
    values = _load(name)
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    args = DPOConfig(**{**values, **TINY_RUN, **TINY_EXTRA.get(name, {}), "output_dir": str(tmp_path)})
    trainer = DPOTrainer(model, args=args, train_dataset=preference_pairs(), processing_class=tok)
    trainer.train()

    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses), losses
    if values.get("sync_ref_model"):  # TR-DPO: the reference moved towards the policy
        assert trainer.ref_model is not None
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.ref_model.parameters(), strict=True))


# ---- posttrain dpo --config recipes/dpo/<name>.yaml ----------------------------------------------


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_read_by_the_cli(name, tmp_path):
    """``posttrain dpo --config`` takes every recipe; the recipe's values win over the CLI's defaults."""
    script, config = parse_config(
        ["--config", str(_path(name)), "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"],
        PairTaskScriptArguments,
        DPOConfig,
        command="dpo",
        summary="Align with DPO on preference pairs.",
        defaults=dpo_cli.LAPTOP_DEFAULTS,
    )
    assert isinstance(config, DPOConfig)
    for key, value in _load(name).items():
        assert getattr(config, key) == _as_config_value(key, value), key


def test_cli_trains_a_recipe(tmp_path, tiny_model_dir, no_plots):
    """``posttrain dpo --config recipes/dpo/udpo.yaml`` on the tiny model; flags shrink the run."""
    data = tmp_path / "pairs.jsonl"
    preference_pairs().to_json(str(data), lines=True)
    out = tmp_path / "run"
    trainer = dpo_cli.dpo(
        ["--config", str(_path("udpo")), "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data),
         "--output_dir", str(out), "--use_cpu", "--bf16", "false", "--max_steps", "1",
         "--per_device_train_batch_size", "4", "--max_length", "64", "--report_to", "none",
         "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]
    )  # fmt: skip
    assert trainer.state.global_step == 1
    args = trainer.args
    assert (
        args.loss_type == ["udpo"]
        and args.label_smoothing == 4 / 9
        and args.warmup_steps == 0.1
        and args.warmup_ratio == 0.1
    )
    assert args.per_device_train_batch_size == 4 and args.max_grad_norm == 10.0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(loss) for loss in losses)


# ---- the paper index itself -----------------------------------------------------------------------


def _literal(node: ast.expr) -> Any:
    """A literal of the index's DPOConfig calls; ``4 / 9`` is the one computed value."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _literal(node.left) / _literal(node.right)
    return ast.literal_eval(node)


def _index_call(lines: list[str], start: int, end: int) -> dict[str, Any]:
    """The keyword arguments of the ``DPOConfig(...)`` call on index lines ``start``-``end``."""
    text = "\n".join(lines[start - 1 : end])
    assert "DPOConfig(" in lines[start - 1] and lines[end - 1].strip() == ")", (
        f"index lines {start}-{end} are not a DPOConfig(...) call:\n{text}"
    )
    call = ast.parse(text).body[0].value
    assert isinstance(call, ast.Call) and call.func.id == "DPOConfig" and not call.args
    return {kw.arg: _literal(kw.value) for kw in call.keywords}


@pytest.mark.skipif(not INDEX_PATH.is_file(), reason=f"the paper index is not at {INDEX_PATH}")
@pytest.mark.parametrize("name", RECIPES)
def test_the_index_gives_these_examples(name):
    """The heading, arXiv link and DPOConfig call recorded in ``PAPERS`` are the index's."""
    lines = INDEX_PATH.read_text(encoding="utf-8").splitlines()
    paper = PAPERS[name]
    assert lines[paper.heading_line - 1].strip() == paper.heading
    assert f"papers/{paper.arxiv}" in lines[paper.heading_line + 1]
    start, end = paper.lines
    assert paper.heading_line < start
    # no other paper's entry between the heading and the call
    assert not any("papers/" in line for line in lines[paper.heading_line + 2 : start - 1])
    assert _index_call(lines, start, end) == paper.index_values
