"""Many GRPO runs on one copy of a base model: each run trains its own LoRA adapter.

A sweep loads the base model once and gives it one LoRA adapter per run (``peft``'s named
adapters). Each run is an ordinary :class:`~posttrain.GRPOTrainer` with its own config, reward
functions, dataset, optimizer, scheduler, random generators, output folder, logs and
checkpoints; the runs take the shared model in turns, one optimizer step each
(:mod:`posttrain.sweep.turns`). A run that raises (a diverging loss, a failing reward function)
stops alone and the others go on. See ``docs/sweeps.md``.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback, set_seed

from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models import peft as peft_utils
from posttrain.ops import workspace
from posttrain.ops.threads import release_thread_pool
from posttrain.sweep.generation import SharedGeneration
from posttrain.sweep.turns import RandomState, Turns

#: Config fields that act on the shared base model, so every run of a sweep must give them the same value.
SHARED_FIELDS: tuple[str, ...] = (
    "model_init_kwargs",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "disable_dropout",
    "cast_lm_head_to_fp32",
    "use_liger_kernel",
    "torch_compile",
    "use_cpu",
    "trust_remote_code",
    # vLLM: the runs share one colocated engine (docs/sweeps.md)
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "vllm_model_impl",
    "vllm_tensor_parallel_size",
    "vllm_enable_sleep_mode",
    "vllm_engine_kwargs",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_group_port",
)

#: The summary a sweep writes in its folder: each run's status, step, error and folder.
SUMMARY_FILE = "sweep.json"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass
class SweepRun:
    """One run of a sweep: a name and what a lone ``GRPOTrainer`` would be given.

    Attributes:
        name: the run's name: its adapter's name and its folder under the sweep's folder
            (letters, digits, ``_`` and ``-``).
        args: the run's ``GRPOConfig``. Its ``output_dir`` is replaced by ``<sweep folder>/<name>``
            when the sweep has a folder.
        reward_funcs: the run's reward functions (as ``GRPOTrainer(reward_funcs=...)``).
        train_dataset: the run's prompts.
        eval_dataset: the run's evaluation prompts, if any.
        peft_config: the run's ``peft.LoraConfig``; ``None``: the sweep's.
        trainer_kwargs: any other ``GRPOTrainer`` argument (``rollout_func``, ``callbacks``,
            ``reward_processing_classes``, ``tools``, ...).
    """

    name: str
    args: Any
    reward_funcs: Any = None
    train_dataset: Any = None
    eval_dataset: Any = None
    peft_config: Any = None
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunOutcome:
    """How one run of a sweep ended.

    Attributes:
        name: the run's name.
        status: ``"finished"``, ``"failed"`` (it raised; the others went on) or ``"stopped"``
            (the sweep was interrupted; its last step was saved).
        global_step: the optimizer steps it completed.
        output_dir: its folder (logs, checkpoints, the trained adapter).
        error: the exception's one-line description, for a failed run.
        seconds: wall time of the run's own turns.
    """

    name: str
    status: str
    global_step: int
    output_dir: str
    error: str | None = None
    seconds: float = 0.0


class _StopAtStepEnd(TrainerCallback):
    """Ends a run at its next step end, saving that step, once the sweep is asked to stop."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stop.is_set():
            control.should_training_stop = True
            control.should_save = True
        return control


class GRPOSweep:
    """Train several GRPO runs at once, each its own LoRA adapter on one shared base model.

    Example::

        from peft import LoraConfig
        from posttrain import GRPOConfig
        from posttrain.sweep import GRPOSweep, SweepRun

        runs = [
            SweepRun(name, GRPOConfig(output_dir=name, learning_rate=lr, max_steps=40), reward_funcs=reward,
                     train_dataset=dataset)
            for name, lr in [("lr-1e-5", 1e-5), ("lr-3e-5", 3e-5)]
        ]
        sweep = GRPOSweep("smollm2-135m-instruct", runs, peft_config=LoraConfig(r=16, target_modules="all-linear"),
                          output_dir="my-sweep")
        outcomes = sweep.train()

    Every trainer is built here, before any training, so a bad config of any run fails at once.

    Args:
        model: the base model: a hub id, local folder, embedded name, or a ``PreTrainedModel``
            (not a ``PeftModel``: the sweep adds the adapters).
        runs: the runs, in the order they take turns; names must be distinct.
        peft_config: the ``peft.LoraConfig`` of runs that give none.
        processing_class: the tokenizer shared by every run; ``None``: loaded from the model.
        output_dir: the sweep's folder: run ``name`` writes to ``output_dir/name`` and the summary
            goes to ``output_dir/sweep.json``. ``None``: each run keeps its own ``args.output_dir``
            and no summary file is written.
        trainer_class: the trainer of each run (``GRPOTrainer``, or a subclass of it).
        shared_generation: sample every run's prompts in one generation call per round of
            turns, each row with its run's adapter (:mod:`posttrain.sweep.generation`). False
            (the default): each run samples alone in its turn, with the prompt-prefix sharing of a
            lone run, drawing from its own random stream, so each run equals the same run trained
            alone draw for draw. On a CPU the shared call is not faster yet (docs/sweeps.md).

    Raises:
        ValueError: no run, a repeated or unusable name, two runs writing to one folder, a run
            without a LoRA config, or runs that disagree on a field of :data:`SHARED_FIELDS`.
        NotImplementedError: ``use_vllm=True`` with sleep mode (the runs share one engine, awake).
    """

    def __init__(
        self,
        model: Any,
        runs: list[SweepRun],
        peft_config: Any = None,
        processing_class: Any = None,
        output_dir: str | None = None,
        trainer_class: type | None = None,
        shared_generation: bool = False,
    ) -> None:
        if trainer_class is None:
            from posttrain import GRPOTrainer

            trainer_class = GRPOTrainer
        self.output_dir = output_dir
        self.runs = list(runs)
        _check_runs(self.runs, peft_config, output_dir)
        if output_dir is not None:
            for run in self.runs:
                run.args.output_dir = os.path.join(output_dir, run.name)
        if peft_utils.is_peft_model(model):
            raise ValueError(
                "GRPOSweep adds one adapter per run to the base model: pass the base model (a name, a folder or "
                "a PreTrainedModel), not a PeftModel, and give the LoRA settings as peft_config."
            )
        first = self.runs[0].args
        base, source = trainer_class._setup_model(model, first)
        self.model = self._add_adapters(base, peft_config, first.gradient_checkpointing)
        #: with ``use_vllm``: the one colocated engine every run's adapter is served from
        self.vllm_engine = (
            _shared_engine(self.runs, peft_config) if getattr(first, "use_vllm", False) else None
        )
        self.processing_class = trainer_class._setup_tokenizer(processing_class, source, first)
        self._stop = threading.Event()
        self.trainers: dict[str, Any] = {}
        self._random: dict[str, RandomState] = {}
        self._build_trainers(trainer_class)
        self._share_sampler_copies()
        #: the runs' scratch buffers: one set, since only the run holding the turn computes
        self._scratch: dict = {}
        #: The shared generation calls (None with ``shared_generation=False``).
        self.generation: SharedGeneration | None = None
        if shared_generation:
            self.generation = SharedGeneration(self._hand_over_in_step)
            for name, trainer in self.trainers.items():
                generator = getattr(trainer, "generator", None)
                if (
                    isinstance(generator, TransformersGenerator)
                    or getattr(generator, "shared", None) is not None
                ):
                    self.generation.attach(name, generator)
        self._turns: Turns | None = None
        self._seconds: dict[str, float] = {}
        self._entered: dict[str, float] = {}

    def _build_trainers(self, trainer_class: type) -> None:
        """One trainer per run on the shared model, each built with its adapter active; its random
        generators' state right after (as a lone run's when its ``train`` begins)."""
        sweep_class = _sweep_trainer_class(trainer_class)
        sweep_class._shared_vllm_engine = self.vllm_engine
        for index, run in enumerate(self.runs):
            self.model.set_adapter(run.name)
            trainer = sweep_class(
                model=self.model,
                reward_funcs=run.reward_funcs,
                args=run.args,
                train_dataset=run.train_dataset,
                eval_dataset=run.eval_dataset,
                processing_class=self.processing_class,
                **run.trainer_kwargs,
            )
            trainer._sweep = self
            trainer._sweep_run = run.name
            trainer.add_callback(_StopAtStepEnd(self._stop))
            if index > 0:  # the first trainer's heap hooks serve the shared model
                for hook in trainer._trim_hooks:
                    hook.remove()
                trainer._trim_hooks = []
            self.trainers[run.name] = trainer
            self._random[run.name] = RandomState.capture()

    def _share_sampler_copies(self) -> None:
        """One reduced-precision sampler copy (bf16 training on a bf16 CPU) for every run.

        Each run's generator would keep its own copy of the weights (SmolLM2: 270 MB in bf16), but
        a copy holds one adapter's weights merged in, and a run's turn starts after another run's
        step changed them, so each turn rebuilds it anyway; the copy is built on first use.
        """
        shared: dict[str, Any] = {}
        for trainer in self.trainers.values():
            generator = getattr(trainer, "generator", None)
            copy = getattr(generator, "reduced", None)
            if copy is not None:
                generator.reduced = shared.setdefault(copy.backend, copy)

    def _add_adapters(self, base: Any, default_config: Any, checkpointing: bool) -> Any:
        """The base model with one adapter per run, each created right after ``set_seed(run.args.seed)``.

        A run's adapter then starts as a lone ``GRPOTrainer(peft_config=...)``'s does after
        ``set_seed(seed)``: the same initial weights.
        """
        model = None
        for run in self.runs:
            config = run.peft_config if run.peft_config is not None else default_config
            set_seed(run.args.seed)
            if model is None:  # the lone run's setup, its adapter named after the run
                model = peft_utils.wrap_policy(base, config, checkpointing, adapter_name=run.name)
            else:
                model.add_adapter(run.name, config)
        return model

    # ---- turns --------------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        """Take the shared model for run ``name``: its adapter active, its generators, no gradients."""
        self.model.set_adapter(name)
        self.model.zero_grad(set_to_none=True)
        self._random[name].restore()
        workspace.adopt(self._scratch)
        self._entered[name] = time.perf_counter()

    def _leave(self, name: str) -> None:
        """Give up the shared model: the run's generators saved, its thread's OpenMP team released
        (``ops/threads.py``: a docked team of each run's thread made every run's steps slower)."""
        self._random[name] = RandomState.capture()
        release_thread_pool()
        now = time.perf_counter()
        self._seconds[name] = self._seconds.get(name, 0.0) + now - self._entered.pop(name, now)

    def hand_over(self, name: str) -> None:
        """Called by run ``name`` at the end of each step: the other runs take their turns, then it goes on."""
        assert self._turns is not None
        self._leave(name)
        self._turns.pass_on(name)
        self._turns.wait(name)
        self._enter(name)

    def _hand_over_in_step(self, name: str) -> None:
        """``hand_over`` in the middle of a step (a generation request): the other runs' turns do
        not count in this run's ``step_time``, which then holds its own work and any shared call it made."""
        start = time.perf_counter()
        self.hand_over(name)
        trainer = self.trainers[name]
        trainer._step_time -= time.perf_counter() - start

    def stop(self) -> None:
        """Ask every run to end after its current step, saving it (as on Ctrl-C during :meth:`train`)."""
        self._stop.set()

    # ---- training -----------------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: bool | None = None,
        after_run: Callable[[str, Any], None] | None = None,
    ) -> dict[str, RunOutcome]:
        """Train every run; returns how each ended.

        Args:
            resume_from_checkpoint: ``True`` resumes each run from its newest complete
                checkpoint (a run without one starts from step 0).
            after_run: called as ``after_run(name, trainer)`` in the run's own turn once it
                has finished training and saved (its adapter active): a final evaluation.

        A run that raises is recorded as failed (its error in ``output_dir/error.txt``) and the
        others go on. Ctrl-C asks every run to stop after its current step and save it.
        """
        names = [run.name for run in self.runs]
        self._turns = Turns(names)
        outcomes: dict[str, RunOutcome] = {}
        threads = [
            threading.Thread(
                target=self._run,
                args=(name, resume_from_checkpoint, after_run, outcomes),
                name=f"posttrain-sweep-{name}",
                daemon=True,
            )
            for name in names
        ]
        release_thread_pool()  # the setup's team, in this thread, would slow the runs' teams
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)
        except KeyboardInterrupt:
            self.stop()
            for thread in threads:
                thread.join()
        self.model.set_adapter(names[0])
        if self.vllm_engine is not None:  # its workers' groups go before the process's own
            self.vllm_engine.close()
        ordered = {name: outcomes[name] for name in names}
        if self.output_dir is not None:
            write_summary(self.output_dir, ordered)
        return ordered

    def _run(
        self,
        name: str,
        resume: bool | None,
        after_run: Callable[[str, Any], None] | None,
        outcomes: dict[str, RunOutcome],
    ) -> None:
        assert self._turns is not None
        trainer = self.trainers[name]
        self._turns.wait(name)
        self._enter(name)
        try:
            trainer.train(resume_from_checkpoint=_resume_folder(trainer, resume))
            trainer.save_model(trainer.args.output_dir)
            trainer.save_state()
            if after_run is not None:
                after_run(name, trainer)
            status, error = ("stopped" if self._stop.is_set() else "finished"), None
        except Exception as exc:  # a failing run stops alone
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            _write_error(trainer.args.output_dir, traceback.format_exc())
        finally:
            self.model.zero_grad(set_to_none=True)
            self._leave(name)
            outcomes[name] = RunOutcome(
                name,
                status,
                trainer.state.global_step,
                trainer.args.output_dir,
                error,
                self._seconds.get(name, 0.0),
            )
            self._turns.leave(name)


def _resume_folder(trainer: Any, resume: bool | None) -> Any:
    """``True`` becomes the run's newest complete checkpoint, or ``None`` when it has none yet."""
    if resume is not True:
        return resume
    from posttrain.core import checkpoints

    return checkpoints.latest_complete_checkpoint(trainer.args.output_dir)


def _write_error(folder: str, text: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "error.txt"), "w") as f:
        f.write(text)


def write_summary(folder: str, outcomes: dict[str, RunOutcome], extra: dict[str, dict] | None = None) -> str:
    """Write ``folder/sweep.json``: each run's outcome (and ``extra[name]``, such as its accuracy)."""
    os.makedirs(folder, exist_ok=True)
    runs = []
    for name, outcome in outcomes.items():
        entry = {
            "name": name,
            "status": outcome.status,
            "global_step": outcome.global_step,
            "output_dir": os.path.relpath(outcome.output_dir, folder),
            "error": outcome.error,
            "seconds": round(outcome.seconds, 3),
        }
        entry.update((extra or {}).get(name, {}))
        runs.append(entry)
    path = os.path.join(folder, SUMMARY_FILE)
    with open(path, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    return path


def _check_runs(runs: list[SweepRun], peft_config: Any, output_dir: str | None) -> None:
    """Refuse a sweep that cannot run, before any model is loaded."""
    if not runs:
        raise ValueError("GRPOSweep needs at least one SweepRun.")
    names = [run.name for run in runs]
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(
                f"sweep run name {name!r} is not usable as a folder and adapter name: use letters, digits, "
                "'_' and '-', starting with a letter or digit."
            )
        if name in "lora_":  # peft finds its adapters' weights by this prefix
            raise ValueError(
                f"sweep run name {name!r} is part of peft's prefix 'lora_': choose another name."
            )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"sweep run names must be distinct; repeated: {repeated}.")
    if output_dir is None:
        folders = [os.path.abspath(run.args.output_dir) for run in runs]
        shared = sorted({f for f in folders if folders.count(f) > 1})
        if shared:
            raise ValueError(
                f"two runs of the sweep write to the same output_dir {shared[0]!r}: give each its own, or give "
                "GRPOSweep an output_dir (each run then writes to output_dir/<name>)."
            )
    peft = peft_utils._import_peft()
    for run in runs:
        config = run.peft_config if run.peft_config is not None else peft_config
        if config is None:
            raise ValueError(
                f"sweep run {run.name!r} has no LoRA config: give GRPOSweep a peft_config (peft.LoraConfig) or "
                "the run its own."
            )
        if not isinstance(config, peft.LoraConfig):
            raise ValueError(
                f"sweep run {run.name!r}: a sweep trains LoRA adapters (peft.LoraConfig); got "
                f"{type(config).__name__}."
            )
        _check_vllm(run)
    first = runs[0]
    for run in runs[1:]:
        for name in SHARED_FIELDS:
            mine, theirs = getattr(first.args, name, None), getattr(run.args, name, None)
            if mine != theirs:
                raise ValueError(
                    f"sweep runs {first.name!r} and {run.name!r} differ in {name} ({mine!r} against {theirs!r}): "
                    f"{name} acts on the base model the runs share, so every run needs the same value."
                )


def _check_vllm(run: SweepRun) -> None:
    """Refuse what one engine shared by the runs cannot do, before anything loads."""
    args = run.args
    if not getattr(args, "use_vllm", False):
        return
    if args.vllm_enable_sleep_mode:
        raise NotImplementedError(
            f"sweep run {run.name!r} sets vllm_enable_sleep_mode=True: a sweep's shared engine stays awake (sleep "
            "would drop every run's adapter between turns); set vllm_enable_sleep_mode=False."
        )
    if getattr(args, "vllm_lora_sync", None) is False:
        raise ValueError(
            f"sweep run {run.name!r} sets vllm_lora_sync=False: the runs share one vLLM engine, which serves each "
            "run's adapter on its own; a merged push would put one run's adapter into every run's base. Leave "
            "vllm_lora_sync None (or True)."
        )


def _shared_engine(runs: list[SweepRun], default_config: Any) -> Any:
    """The vLLM engine (or server) the runs share: each run's adapter its own slot, the largest rank served."""
    from posttrain.generation.vllm_lora import SharedEngine

    ranks = {run.name: (run.peft_config if run.peft_config is not None else default_config).r for run in runs}
    return SharedEngine(ranks)


def _sweep_trainer_class(trainer_class: type) -> type:
    """``trainer_class`` with the two changes a run of a sweep needs.

    It hands the shared model to the next run after each step's logging, saving and evaluation,
    and it saves only its own adapter, at the top of the folder, as a lone run's
    (``PeftModel.from_pretrained(base, folder)`` loads it; resuming loads it back into the
    run's adapter).
    """

    class SweepRunTrainer(trainer_class):  # type: ignore[misc, valid-type]
        _sweep: GRPOSweep
        _sweep_run: str

        def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> Any:
            result = super()._maybe_log_save_evaluate(*args, **kwargs)
            if not self.control.should_training_stop:
                self._sweep.hand_over(self._sweep_run)
            return result

        def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            if not self.args.should_save:
                return
            save_adapter(self.model, self._sweep_run, output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    SweepRunTrainer.__name__ = SweepRunTrainer.__qualname__ = f"Sweep{trainer_class.__name__}"
    return SweepRunTrainer


def save_adapter(model: Any, name: str, folder: str) -> None:
    """Save adapter ``name`` of ``model`` into ``folder`` as a lone adapter (no subfolder).

    The files are those ``PeftModel.save_pretrained`` writes for an adapter named ``default``:
    ``adapter_config.json`` and ``adapter_model.safetensors``.
    """
    import peft
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    weights = peft.get_peft_model_state_dict(model, adapter_name=name)
    save_file(
        {key: value.detach().contiguous() for key, value in weights.items()},
        os.path.join(folder, "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    model.peft_config[name].save_pretrained(folder)
