"""Test helpers: a scripted generator, small datasets and a config factory."""

from __future__ import annotations

from typing import Any

import torch

from posttrain.generation.base import Samples


class ScriptedGenerator:
    """Returns fixed completions, one per row in batch order (rule 4 of DESIGN.md)."""

    def __init__(self, completions: list[list[int]], pad_token_id: int) -> None:
        self.completions = completions
        self.pad = pad_token_id
        self.calls = 0

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **kwargs: Any) -> Samples:
        rows = [
            self.completions[(self.calls + i) % len(self.completions)] for i in range(prompt_ids.shape[0])
        ]
        self.calls += prompt_ids.shape[0]
        return Samples.from_lists(rows, self.pad, prompt_ids.device)


class TurnScriptedGenerator:
    """A multi-turn test double: answers each row from a script chosen by a key in its prompt.

    ``scripts`` maps a key (a string the row's rendered prompt contains) to the texts of that
    episode's successive assistant turns; the turn is the number of assistant generation prompts
    (``marker``) in the row's input minus one. Each text is tokenised and ended with ``eos``.
    """

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]], marker: str = "<|im_start|>assistant"):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.marker = marker
        self.inputs: list[str] = []

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **kwargs: Any) -> Samples:
        eos = self.tokenizer.eos_token_id
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True):
            text = self.tokenizer.decode(
                [t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
            )
            self.inputs.append(text)
            key = next(k for k in self.scripts if k in text)
            turn = text.count(self.marker) - 1
            script = self.scripts[key]
            reply = script[min(turn, len(script) - 1)]
            rows.append(self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos])
        return Samples.from_lists(rows, self.tokenizer.pad_token_id or eos, prompt_ids.device)


#: The training arguments every small CPU test run shares (a trainer's tests add their own).
CPU_TEST_ARGS: dict[str, Any] = {
    "per_device_train_batch_size": 4,
    "max_steps": 2,
    "logging_steps": 1,
    "learning_rate": 1e-2,
    "bf16": False,
    "use_cpu": True,
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "gradient_checkpointing": False,
}


def make_config(tmp_path: Any, **overrides: Any):
    """A small CPU GRPOConfig for tests; overrides win."""
    from posttrain import GRPOConfig

    values: dict[str, Any] = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "num_generations": 4}
    values["max_completion_length"] = 8
    values.update(overrides)
    return GRPOConfig(**values)


def standard_dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [f"Question {i}: what is {i} plus one?" for i in range(n)],
            "solution": [str(i + 1) for i in range(n)],
        }
    )


def conversational_dataset(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(n)],
            "solution": [str(i + 1) for i in range(n)],
        }
    )


def length_reward(completion_ids, **kwargs):
    """Number of completion tokens."""
    return [float(len(ids)) for ids in completion_ids]


def make_trainer(tok, reward_funcs, args, dataset=None, model=None, **kwargs):
    """A GRPOTrainer on a fresh tiny model (or ``model``) and the standard dataset (or ``dataset``)."""
    from conftest import build_tiny_model

    from posttrain import GRPOTrainer

    return GRPOTrainer(
        model=model if model is not None else build_tiny_model(tok),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset if dataset is not None else standard_dataset(),
        processing_class=tok,
        **kwargs,
    )


def left_pad(rows: list[list[int]], pad: int) -> tuple[Any, Any]:
    """Token rows left-padded with ``pad`` into ``[N, P]`` ids and their attention mask."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def run_torchrun(script: str, out_dir: str, port: int, *args: str) -> Any:
    """Run ``script OUT_DIR ARGS`` on 2 CPU processes under torchrun (gloo, one thread each)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    return subprocess.run(
        [*cmd, script, out_dir, *args], env=env, capture_output=True, text=True, timeout=600
    )
