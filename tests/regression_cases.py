"""The GRPO regression fixture: fixed runs whose logged metrics and final parameters are recorded.

Recorded once, before the trainer was moved onto the shared core (issue "One core under every
trainer"), so that the move, and any later refactor, can be checked to change nothing:

    python tests/regression_cases.py --record        # writes tests/fixtures/grpo_regression.json

``tests/test_regression_fixture.py`` reruns every case and compares. On the host that recorded
the fixture the parameters must match bit for bit (their SHA-256); on another host (other
matrix kernels) within the tolerance that test derives from the measured spread, which this
command measures again on the host it runs on (every case under each of ``KERNEL_SETS``):

    python tests/regression_cases.py --spread

Cases: ``default`` (sampling from the tiny model, the default loss), ``grpo_kl`` (loss_type
"grpo", a KL reference, two iterations per generation, so old log-probs are computed),
``tools`` (an environment with a tool, driven by a scripted generator), ``two_processes``
(the default case's settings on two gloo processes under torchrun; ``scripts/regression_ddp.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
FIXTURE = HERE / "fixtures" / "grpo_regression.json"
DDP_SCRIPT = HERE / "scripts" / "regression_ddp.py"

#: Logged values that measure time, not behaviour.
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def host() -> str:
    """What decides the float kernels: the CPU model and flags, and the torch version."""
    import torch

    cpu = platform.processor()
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags")), "")
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{cpu} | flags {digest} | torch {torch.__version__}"


def summary(trainer: Any) -> dict[str, Any]:
    """The logged metrics (timings dropped) and the final parameters: SHA-256, sums, a few values."""
    import torch

    digest = hashlib.sha256()
    total, squares, probes = 0.0, 0.0, []
    for p in trainer.model.parameters():
        values = p.detach().to(torch.float64).flatten()
        digest.update(p.detach().to(torch.float32).numpy().tobytes())
        total += values.sum().item()
        squares += (values * values).sum().item()
        probes.append(values[:: max(values.numel() // 3, 1)][:3].tolist())
    logs = [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in trainer.state.log_history]
    return {
        "logs": logs,
        "params": {"sha256": digest.hexdigest(), "sum": total, "sum_of_squares": squares, "probes": probes},
    }


def _reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Deterministic and spread: the token ids' sum modulo 5."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def _config(out: str, **overrides: Any) -> Any:
    from helpers import make_config

    values: dict[str, Any] = {"max_steps": 3, "seed": 7, "learning_rate": 5e-2, "max_completion_length": 12}
    values.update(overrides)
    return make_config(out, **values)


def case_default(out: str) -> dict[str, Any]:
    from conftest import build_tiny_model, build_tiny_tokenizer
    from helpers import make_trainer

    tok = build_tiny_tokenizer()
    trainer = make_trainer(tok, _reward, _config(out), model=build_tiny_model(tok, seed=3))
    trainer.train()
    return summary(trainer)


def case_grpo_kl(out: str) -> dict[str, Any]:
    from conftest import build_tiny_model, build_tiny_tokenizer
    from helpers import make_trainer

    tok = build_tiny_tokenizer()
    args = _config(
        out,
        loss_type="grpo",
        beta=0.04,
        num_iterations=2,
        steps_per_generation=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        scale_rewards="batch",
    )
    trainer = make_trainer(tok, _reward, args, model=build_tiny_model(tok, seed=4))
    trainer.train()
    return summary(trainer)


def case_tools(out: str) -> dict[str, Any]:
    from helpers import make_trainer
    from test_agent_loop import SCRIPTS, IncrementEnv, long_context_model, qwen_tokenizer, task_dataset

    tok = qwen_tokenizer()
    args = _config(
        out, per_device_train_batch_size=8, num_generations=2, max_steps=2, max_completion_length=200
    )

    def turns(completions: list[Any], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    trainer = make_trainer(
        tok,
        turns,
        args,
        dataset=task_dataset(),
        model=long_context_model(tok),
        environment_factory=IncrementEnv,
    )
    trainer.generator = _HalfCallScripted(tok, SCRIPTS)
    trainer.train()
    return summary(trainer)


def _HalfCallScripted(tok: Any, scripts: dict[str, list[str]]) -> Any:
    """The scripted episodes, except that every other row answers at once without a tool call,
    so that the completions of a group differ and their advantages are not all 0."""
    from helpers import TurnScriptedGenerator

    class HalfCallScripted(TurnScriptedGenerator):
        def generate(self, prompt_ids: Any, prompt_mask: Any, **kwargs: Any) -> Any:
            samples = super().generate(prompt_ids, prompt_mask, **kwargs)
            first_turn = [text.count(self.marker) == 1 for text in self.inputs[-prompt_ids.shape[0] :]]
            answer = self.tokenizer("The answer is 2.", add_special_tokens=False)["input_ids"]
            rows = [
                ids[:n]
                for ids, n in zip(samples.completion_ids.tolist(), samples.lengths.tolist(), strict=True)
            ]
            for i in range(0, len(rows), 2):
                if first_turn[i]:
                    rows[i] = answer + [self.tokenizer.eos_token_id]
            return type(samples).from_lists(rows, self.tokenizer.eos_token_id, prompt_ids.device)

    return HalfCallScripted(tok, scripts)


def case_two_processes(out: str) -> dict[str, Any]:
    from helpers import run_torchrun

    proc = run_torchrun(str(DDP_SCRIPT), out, 29541)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads((Path(out) / "rank0.json").read_text())


CASES = {
    "default": case_default,
    "grpo_kl": case_grpo_kl,
    "tools": case_tools,
    "two_processes": case_two_processes,
}

#: Kernel sets one host can run, standing in for other hosts' float kernels (``--spread``).
KERNEL_SETS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512_without_amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "mkl_cbwr_compatible": {"MKL_CBWR": "COMPATIBLE"},
    "sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "unvectorised": {"ATEN_CPU_CAPABILITY": "default"},
}


def kind(where: str) -> str:
    """The kind of a recorded value at ``where`` (``case.logs[0].loss``, ``case.params.probes[3][1]``):
    ``first`` (a metric of the first step), ``later`` (of a later step), ``probe`` or ``sum``."""
    import re

    if ".params.probes" in where:
        return "probe"
    if ".params." in where:
        return "sum"
    step = re.search(r"\.logs\[(\d+)\]", where)
    return "first" if step is not None and step.group(1) == "0" else "later"


def _floats(value: Any, where: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _floats(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _floats(v, f"{where}[{i}]")
    elif isinstance(value, float) and value == value:
        yield where, value


def measure_spread() -> None:
    """Rerun every case under each kernel set (a subprocess each) and print, by kind of value, the
    largest difference from the recording: relative for metrics and sums, absolute for probes."""
    import subprocess
    import tempfile

    recorded = json.loads(FIXTURE.read_text())["cases"]
    worst: dict[str, tuple[float, str]] = {}
    for label, env in KERNEL_SETS.items():
        for name in CASES:
            with tempfile.TemporaryDirectory() as out:
                code = (
                    "import json, sys, torch; sys.path.insert(0, sys.argv[1]); torch.set_num_threads(1); "
                    "from regression_cases import CASES; print(json.dumps(CASES[sys.argv[2]](sys.argv[3])))"
                )
                proc = subprocess.run(
                    [sys.executable, "-c", code, str(HERE), name, out],
                    env={**os.environ, **env, "HF_HUB_OFFLINE": "1"},
                    capture_output=True,
                    text=True,
                    check=True,
                )
            actual = dict(_floats(json.loads(proc.stdout.strip().splitlines()[-1]), name))
            for where, expected in _floats(recorded[name], name):
                gap = abs(actual[where] - expected)
                size = gap if kind(where) == "probe" else gap / max(abs(expected), 1e-7)
                if size > worst.get(kind(where), (0.0, ""))[0]:
                    worst[kind(where)] = (size, f"{where} under {label}")
            print(f"ran {name} under {label}", flush=True)
    print(f"host: {host()}")
    for k, (size, where) in sorted(worst.items()):
        print(f"{k:6s} {size:.2e}  ({where})")


def record() -> None:
    """Run every case and write the fixture."""
    import tempfile

    import torch

    torch.set_num_threads(1)
    results = {}
    for name, run in CASES.items():
        with tempfile.TemporaryDirectory() as out:
            results[name] = run(out)
        print(f"recorded {name}", flush=True)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({"host": host(), "cases": results}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1:] == ["--record"]:
        record()
    elif sys.argv[1:] == ["--spread"]:
        measure_spread()
    else:
        sys.exit("usage: python tests/regression_cases.py --record | --spread")
