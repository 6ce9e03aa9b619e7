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


#: Plain SGD steps (no clipping, a constant rate): a step's update is the gradient, so two runs
#: that must compute the same gradient end with the same parameters.
SGD_ARGS: dict[str, Any] = {
    "optim": "sgd",
    "learning_rate": 0.5,
    "max_grad_norm": 0.0,
    "lr_scheduler_type": "constant",
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


class RankScriptedGenerator:
    """Answers row ``i`` of call ``c`` with ``script[(c * stride + offset + i) % len(script)]``: a
    process's share of the completions a one-process run (offset 0) gets for the same step."""

    def __init__(self, script: list[list[int]], offset: int, stride: int) -> None:
        self.script, self.offset, self.stride, self.calls = script, offset, stride, 0

    def generate(self, prompt_ids: Any, prompt_mask: Any, **kwargs: Any) -> Any:
        from posttrain.generation.base import Samples

        start = self.calls * self.stride + self.offset
        rows = [self.script[(start + i) % len(self.script)] for i in range(prompt_ids.shape[0])]
        self.calls += 1
        return Samples.from_lists(rows, 0, prompt_ids.device)


#: Logged fractions that count the sign of another logged value: at a tie (the policy still
#: equal to its reference, a margin of 0) the two runs' last bits decide them, as in
#: (policy - reference) = +1e-6 on two processes and 0.0 on one (seen on an AVX-512 host).
SIGN_OF = {"rewards/accuracies": "rewards/margins"}


def two_processes_against_one(
    module: str,
    build: Any,
    script: list[list[int]],
    tmp_path: Any,
    port: int,
    sizes: tuple[int, int],
    keys: tuple[str, ...],
) -> list[dict[str, Any]]:
    """Train an online family on 2 processes (``scripts/online_family_ddp.py``) and on 1, with the same
    completions, and check that both ranks end with the one-process parameters and logged ``keys``.

    Args:
        module: the test module whose ``ddp_comparable_trainer`` (``build``) builds the run; its
            ``ddp_generator(trainer)``, when it has one, replaces the rank-scripted completions.
        build: ``build(out_dir, size, **overrides)``.
        script: the scripted completions.
        tmp_path, port: where the runs write, the rendezvous port.
        sizes: the batch size per process of the 2-process run and of the 1-process run.
        keys: the logged metrics compared.

    Returns:
        The one-process run's logs.
    """
    import importlib
    import os

    import pytest
    import torch

    runner = os.path.join(os.path.dirname(__file__), "scripts", "online_family_ddp.py")
    proc = run_torchrun(runner, str(tmp_path), port, module, str(sizes[0]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    one = build(str(tmp_path / "one"), sizes[1])
    own = getattr(importlib.import_module(module), "ddp_generator", None)
    one.generator = (
        own(one)
        if own is not None
        else RankScriptedGenerator(script, offset=0, stride=one.args.generation_batch_size)
    )
    one.train()
    logs = [{k: v for k, v in h.items() if k != "step_time"} for h in one.state.log_history if "loss" in h]
    for rank in ranks:
        for a, b in zip(rank["params"], one.model.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-6)
        for got, want in zip(rank["logs"], logs, strict=True):
            for key in keys:
                if key in SIGN_OF and abs(want[SIGN_OF[key]]) <= 1e-5:
                    continue  # a tie: float noise of the kernels (batch shapes differ) picks the sign
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    return logs


def leave_without_teardown() -> None:
    """End a torchrun test script once its rank's results are written and its process group destroyed.

    Leaves without the interpreter's teardown, where gloo's worker threads can still abort the
    process ("terminate called without an active exception", a rare SIGABRT that fails the launch).
    """
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
