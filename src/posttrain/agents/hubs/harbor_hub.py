"""Harbor task suites (``harbor``) as posttrain environments.

A Harbor task is a folder: ``instruction.md`` (the task), ``task.toml`` (its settings),
``environment/`` (the sandbox image, a Dockerfile or a compose file) and ``tests/`` (the verifier,
which writes the reward). Harbor runs the sandbox on a backend it names (``docker``, ``podman``,
``e2b``, ``daytona``, ``modal``, ...; every one of them a container, a VM or a cloud sandbox) and
the verifier inside it. The adapter is an *external agent* in Harbor's terms: the model under
training drives the episode turn by turn and its tool runs commands in the sandbox through
Harbor's environment interface, in process (Harbor's async client runs on one event loop per
instance, on its own thread).

- ``reset(task_dir)`` (a dataset column; ``harbor_tasks`` makes such a dataset) stops the
  instance's previous sandbox, starts the task's sandbox and returns the task's instruction.
- One tool, ``bash(command)``, runs a shell command in the sandbox and returns its output.
- ``get_reward()`` runs the task's verifier in the sandbox, once per episode, and returns its
  ``reward`` (or its first reward when it has no key of that name); the episode is then over and
  its sandbox stops.

``harbor`` needs Python >= 3.12.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path
from typing import Any

from posttrain.agents.hubs._common import LoopThread, make_class, require

HUB = "Harbor"
# Output of one command that reaches the model, in characters.
MAX_OUTPUT_CHARS = 8000


def _harbor(module: str = "harbor") -> Any:
    return require(module, hub=HUB, extra="harbor", note=" (harbor needs Python >= 3.12)")


def _preflight(environment_type: str | None, import_path: str | None, kwargs: dict[str, Any]) -> None:
    """Harbor's own check of a sandbox backend (its options, its daemon or credentials).

    Raises:
        RuntimeError: the backend cannot run here; the message names it and quotes Harbor.
    """
    factory = _harbor("harbor.environments.factory").EnvironmentFactory
    backend = import_path or environment_type
    try:
        factory.run_preflight(environment_type, import_path=import_path, kwargs=kwargs or None)
    except (SystemExit, Exception) as exc:  # Harbor exits (SystemExit) when a daemon or key is missing
        raise RuntimeError(
            f"Harbor's sandbox backend {backend!r} cannot run here: {str(exc).rstrip('.')}. Every Harbor backend runs the task in a "
            "container, VM or cloud sandbox: start its daemon (docker, podman) or give its credentials "
            "(e2b, daytona, modal, ...), or pick another with environment_type=."
        ) from exc


class HarborEnvironment:
    """Base of the classes ``harbor_environment`` makes: one Harbor sandbox per episode."""

    _environment_type: str | None = "docker"
    _import_path: str | None = None
    _kwargs: dict[str, Any] = {}
    _exec_timeout: int = 180
    _prompt_suffix: str = ""

    def __init__(self) -> None:
        _harbor()
        self._loop = LoopThread(f"harbor-{type(self).__name__}")
        self._sandbox: Any = None
        self._task: Any = None
        self._paths: Any = None
        self._reward: float | None = None
        self._scored = False

    def reset(self, task_dir: str | None = None, **kwargs: Any) -> str:
        """Start the sandbox of the task in ``task_dir`` and return its instruction."""
        if task_dir is None:
            raise ValueError(
                f"{type(self).__name__}.reset() needs a 'task_dir' column naming the Harbor task folder; build the "
                "train_dataset with posttrain.agents.hubs.harbor_tasks(path)."
            )
        self._reward, self._scored = None, False
        instruction = self._loop.run(self._start(Path(task_dir)))
        return instruction + self._prompt_suffix

    async def _start(self, task_dir: Path) -> str:
        task_mod = _harbor("harbor.models.task.task")
        config_mod = _harbor("harbor.models.trial.config")
        paths_mod = _harbor("harbor.models.trial.paths")
        factory = _harbor("harbor.environments.factory").EnvironmentFactory
        await self._stop()
        self._task = task_mod.Task(task_dir=task_dir)
        self._paths = paths_mod.TrialPaths(trial_dir=Path(tempfile.mkdtemp(prefix="posttrain_harbor_")))
        config = config_mod.EnvironmentConfig(
            type=self._environment_type, import_path=self._import_path, kwargs=dict(self._kwargs)
        )
        sandbox = factory.create_environment_from_config(
            config=config,
            environment_dir=self._task.paths.environment_dir,
            environment_name=self._task.short_name,
            session_id=uuid.uuid4().hex,
            trial_paths=self._paths,
            task_env_config=self._task.config.environment,
        )
        await sandbox.start(force_build=False)
        self._sandbox = sandbox  # only a started sandbox runs tools and the verifier
        await sandbox.run_healthcheck()
        return str(self._task.instruction)

    def bash(self, command: str) -> str:
        """Run a shell command in the task's sandbox and return its combined stdout and stderr.

        Args:
            command: The shell command to run (each call starts a fresh shell).

        Returns:
            The command's output, cut to 8000 characters, or its exit code when it printed nothing.
        """
        if self._sandbox is None:
            raise RuntimeError("no sandbox is running: reset() starts one.")
        result = self._loop.run(self._sandbox.exec(command, timeout_sec=self._exec_timeout))
        out = (result.stdout or "") + (result.stderr or "")
        if len(out) > MAX_OUTPUT_CHARS:
            out = out[:MAX_OUTPUT_CHARS] + "\n... [cut]"
        return out or f"(no output, exit code {result.return_code})"

    def get_reward(self) -> float | None:
        """The verifier's reward for the episode (run once, after the episode), then the sandbox stops.

        The episode is over once it is scored, so its sandbox (container, image, network) is
        removed here rather than at the next ``reset``: the last episode of each instance would
        otherwise leave its sandbox running after training.
        """
        if self._scored:
            return self._reward
        if self._sandbox is None:
            return None
        try:
            self._reward = self._loop.run(self._verify())
        finally:
            self._scored = True
            self._loop.run(self._stop())
        return self._reward

    async def _verify(self) -> float | None:
        config_mod = _harbor("harbor.models.trial.config")
        paths_mod = _harbor("harbor.models.trial.paths")
        verifiers = _harbor("harbor.verifier.factory").VerifierFactory
        env_paths = paths_mod.EnvironmentPaths.for_os(self._sandbox.os)
        await self._sandbox.empty_dirs([env_paths.verifier_dir], chmod=True)
        verifier = verifiers.create_verifier_from_config(
            config_mod.VerifierConfig(),
            task=self._task,
            trial_paths=self._paths,
            environment=self._sandbox,
            override_env=self._task.config.verifier.env or None,
        )
        rewards = (await verifier.verify()).rewards or {}
        if not rewards:
            return None
        return float(rewards.get("reward", next(iter(rewards.values()))))

    async def _stop(self) -> None:
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await sandbox.stop(delete=True)


def harbor_environment(
    *,
    environment_type: str | None = "docker",
    import_path: str | None = None,
    kwargs: dict[str, Any] | None = None,
    name: str = "HarborEnvironment",
    exec_timeout: int = 180,
    prompt_suffix: str = "",
) -> type:
    """An environment class for ``environment_factory`` running Harbor tasks in Harbor's sandboxes.

    Runs Harbor's preflight of the backend now (a missing Docker daemon, a missing cloud key), so
    a backend that cannot run fails here, before any trainer is built.

    Args:
        environment_type: Harbor's sandbox backend (``"docker"``, ``"podman"``, ``"e2b"``, ...).
        import_path: a ``"module:Class"`` Harbor environment class instead of a built-in backend.
        kwargs: the backend's options, passed to Harbor.
        name: the class name, which names the reward column.
        exec_timeout: seconds one ``bash`` command may run.
        prompt_suffix: text appended to each instruction (how to submit, say).

    Raises:
        ImportError: ``harbor`` is not installed (``pip install "posttrain[harbor]"``, Python >= 3.12).
        RuntimeError: Harbor's preflight refuses the backend (no daemon, no credentials).
    """
    _harbor()
    _preflight(environment_type, import_path, dict(kwargs or {}))
    namespace = {
        "_environment_type": environment_type,
        "_import_path": import_path,
        "_kwargs": dict(kwargs or {}),
        "_exec_timeout": int(exec_timeout),
        "_prompt_suffix": prompt_suffix,
    }
    return make_class(name, HarborEnvironment, namespace)


def harbor_tasks(path: str | Path, *, num_tasks: int | None = None) -> Any:
    """A ``train_dataset`` of a Harbor task tree: a ``task_dir`` column, one row per task folder.

    ``path`` is a task folder, a folder of task folders, or one with a ``tasks/`` folder; a task
    folder is one holding ``instruction.md``. The instruction comes from ``reset``, so there is
    no ``prompt`` column.

    Raises:
        ImportError: ``harbor`` is not installed.
        FileNotFoundError: no task folder under ``path``.
        ValueError: ``num_tasks`` < 1.
    """
    from datasets import Dataset

    task_mod = _harbor("harbor.models.task.task")
    if num_tasks is not None and num_tasks < 1:
        raise ValueError(
            f"num_tasks={num_tasks!r} is invalid: it must be a positive integer or None (all tasks)."
        )
    root = Path(path).expanduser().resolve()
    if (root / "tasks").is_dir():
        root = root / "tasks"
    dirs = (
        [root]
        if (root / "instruction.md").is_file()
        else sorted(p.parent for p in root.glob("*/instruction.md"))
    )
    if not dirs:
        raise FileNotFoundError(
            f"No Harbor task under {path}: a task folder holds instruction.md and task.toml."
        )
    dirs = dirs[:num_tasks] if num_tasks is not None else dirs
    names = [task_mod.Task(task_dir=d).short_name for d in dirs]  # Harbor reads (and checks) each task
    return Dataset.from_dict({"task_dir": [str(d) for d in dirs], "task_name": names})
