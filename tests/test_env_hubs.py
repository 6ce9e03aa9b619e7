"""Environment hubs through environment_factory (posttrain.agents.hubs), each against a real server of
its own package started here: an OpenEnv game served by openenv-core, an ORS task served by the
openreward SDK. A scripted generator writes the model's tool calls; everything past it (the adapter,
the hub's client, the server, the reward) is real. Harbor needs Python >= 3.12 and a sandbox backend:
its tests go as far as the machine allows (test_harbor_up_to_the_sandbox_boundary without a Docker
daemon, test_harbor_grpo_training_in_a_docker_sandbox with one; docs/agents.md, Harbor).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import TurnScriptedGenerator, make_config

SCRIPTS_DIR = Path(__file__).parent / "scripts"
QWEN25 = (Path(__file__).parent / "chat_templates" / "qwen2_5_instruct.jinja").read_text()
SERVER_START_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(script: str, tmp_dir: Path):
    """Run ``tests/scripts/<script> PORT LOG`` and wait until its port accepts connections."""
    port, log = free_port(), tmp_dir / "calls.jsonl"
    out = open(tmp_dir / "server.out", "w")  # noqa: SIM115 - closed in stop_server
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS_DIR / script), str(port), str(log)], stdout=out, stderr=out
    )
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out.close()
            pytest.fail(
                f"{script} exited with {proc.returncode}:\n{(tmp_dir / 'server.out').read_text()[-3000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, out, f"http://127.0.0.1:{port}", log
        except OSError:
            time.sleep(0.2)
    stop_server(proc, out)
    pytest.fail(f"{script} did not listen on port {port} within {SERVER_START_S} s")


def stop_server(proc, out) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.close()


@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory):
    pytest.importorskip("openenv.core")
    proc, out, url, log = start_server("hub_openenv_server.py", tmp_path_factory.mktemp("openenv"))
    yield url, log
    stop_server(proc, out)


@pytest.fixture(scope="module")
def openenv_mcp_server(tmp_path_factory):
    pytest.importorskip("openenv.core")
    pytest.importorskip("fastmcp")
    proc, out, url, log = start_server("hub_openenv_mcp_server.py", tmp_path_factory.mktemp("openenv_mcp"))
    yield url, log
    stop_server(proc, out)


@pytest.fixture(scope="module")
def ors_server(tmp_path_factory):
    pytest.importorskip("openreward")
    proc, out, url, log = start_server("hub_ors_server.py", tmp_path_factory.mktemp("ors"))
    yield url, log
    stop_server(proc, out)


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def qwen_tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = QWEN25
    return tok


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def hub_trainer(tmp_path, tok, factory, dataset, **config):
    """GRPO on the tiny long-context model, 2 steps, the environment as the only reward."""
    from posttrain import GRPOTrainer

    model = build_tiny_model(tok)
    model.config.max_position_embeddings = 4096
    values = {"num_generations": 2, "max_steps": 2, "max_completion_length": 400, **config}
    return GRPOTrainer(
        model=model,
        args=make_config(tmp_path, **values),
        train_dataset=dataset,
        processing_class=tok,
        environment_factory=factory,
    )


def reward_logs(trainer, name: str) -> list[float]:
    return [e[f"rewards/{name}/mean"] for e in trainer.state.log_history if f"rewards/{name}/mean" in e]


# ---------------------------------------------------------------------------------------------
# OpenEnv
# ---------------------------------------------------------------------------------------------


def test_openenv_adapter_describes_the_servers_action(openenv_server):
    from posttrain.agents.environments import environment_tools
    from posttrain.agents.hubs import openenv_environment

    url, _ = openenv_server
    Guess = openenv_environment(url)
    assert Guess.__name__ == "GuessEnvironment"  # the name the server reports
    env = Guess()
    tools = environment_tools(env)
    assert list(tools) == ["guess"]  # GuessAction -> guess
    function = tools["guess"].schema["function"]
    assert function["description"] == "Guess the secret number."
    assert function["parameters"]["required"] == ["number"]
    assert "metadata" not in function["parameters"]["properties"]
    assert env.reset(secret=2) == "Guess the secret number, from 1 to 5."
    assert tools["guess"].fn(number=1) == "Wrong: go higher."
    assert env.get_reward() == 0.0
    assert tools["guess"].fn(number=2) == "Correct!"
    assert env.get_reward() == 1.0
    with pytest.raises(RuntimeError, match="the episode is over"):
        tools["guess"].fn(number=2)


def test_openenv_grpo_training_against_a_local_server(tmp_path, openenv_server):
    from datasets import Dataset

    from posttrain.agents.hubs import openenv_environment

    url, log = openenv_server
    tok = qwen_tokenizer()
    factory = openenv_environment(url)
    # 4 tasks, 2 per step: tasks 0 and 1 guess right at once, task 2 after a miss, task 3 never.
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"task {k}: play the game."}] for k in range(4)],
            "secret": [3, 4, 2, 5],
        }
    )
    scripts = {
        "task 0": [call("guess", '{"number": 3}'), "Won."],
        "task 1": [call("guess", '{"number": 4}'), "Won."],
        "task 2": [call("guess", '{"number": 1}'), call("guess", '{"number": 2}'), "Won."],
        "task 3": [call("guess", '{"number": 1}'), "I give up."],
    }
    before = len(events(log))
    trainer = hub_trainer(tmp_path, tok, factory, dataset)
    trainer.generator = TurnScriptedGenerator(tok, scripts)
    trainer.train()
    rewards = reward_logs(trainer, "GuessEnvironment")
    assert len(rewards) == 2
    # one epoch over the 4 tasks, 2 completions each: 3 of 4 tasks won -> 0.75 over the two steps
    assert sum(rewards) / 2 == pytest.approx(0.75)
    seen = events(log)[before:]
    resets = [e["secret"] for e in seen if e["event"] == "reset"]
    steps = [(e["secret"], e["number"]) for e in seen if e["event"] == "step"]
    assert sorted(resets) == [2, 2, 3, 3, 4, 4, 5, 5]  # every episode reset the server with its row's secret
    assert sorted(steps) == sorted([(3, 3)] * 2 + [(4, 4)] * 2 + [(2, 1), (2, 2)] * 2 + [(5, 1)] * 2)


def test_openenv_mcp_adapter_lists_the_servers_tools(openenv_mcp_server):
    from posttrain.agents.environments import environment_tools
    from posttrain.agents.hubs import openenv_environment
    from posttrain.agents.hubs.openenv_hub import OpenEnvMCPEnvironment

    url, log = openenv_mcp_server
    Vault = openenv_environment(url)  # the server's action is CallToolAction: an MCP environment
    assert Vault.__name__ == "VaultEnvironment" and issubclass(Vault, OpenEnvMCPEnvironment)
    env = Vault()
    tools = environment_tools(env)
    assert sorted(tools) == ["fail", "guess", "hint", "picture"]
    # each tool is described by the JSON schema FastMCP made for it, as list_tools gives it
    assert tools["guess"].schema["function"] == {
        "name": "guess",
        "description": "Guess the secret number, from 1 to 5.",
        "parameters": {
            "additionalProperties": False,
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
            "type": "object",
        },
    }
    hint = tools["hint"].schema["function"]["parameters"]["properties"]["kind"]
    assert hint == {"default": "parity", "enum": ["parity", "size"], "type": "string"}
    before = len(events(log))
    assert env.reset(secret=4) == "Open the vault: find the secret number, from 1 to 5."
    assert tools["hint"].fn() == "The secret is even."
    assert tools["hint"].fn(kind="size") == "The secret is above 3."
    assert tools["guess"].fn(number=1) == "Wrong: go higher."
    assert env.get_reward() == 0.0
    text, image = tools["picture"].fn()  # an MCP image content block becomes a PIL image block
    assert text == {"type": "text", "text": "The door:"}
    assert image["type"] == "image" and image["image"].size == (4, 2)
    assert image["image"].convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(RuntimeError, match="the vault is jammed"):  # the tool's error, for the model
        tools["fail"].fn()
    assert tools["guess"].fn(number=4) == "Correct!"
    assert env.get_reward() == 1.0  # the reward the server's step reported
    with pytest.raises(RuntimeError, match="the episode is over"):
        tools["guess"].fn(number=4)
    seen = [(e["event"], e.get("number", e.get("kind"))) for e in events(log)[before:]]
    assert seen == [("reset", None), ("hint", "parity"), ("hint", "size"), ("guess", 1), ("guess", 4)]


def test_openenv_mcp_grpo_training_against_a_local_server(tmp_path, openenv_mcp_server):
    from datasets import Dataset

    from posttrain.agents.hubs import openenv_environment

    url, log = openenv_mcp_server
    tok = qwen_tokenizer()
    factory = openenv_environment(url)
    # 4 tasks, 2 per step: task 0 asks a hint then guesses right, task 1 guesses right at once,
    # task 2 after a miss, task 3 never.
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"task {k}: open the vault."}] for k in range(4)],
            "secret": [3, 4, 2, 5],
        }
    )
    scripts = {
        "task 0": [call("hint", '{"kind": "parity"}'), call("guess", '{"number": 3}'), "Open."],
        "task 1": [call("guess", '{"number": 4}'), "Open."],
        "task 2": [call("guess", '{"number": 1}'), call("guess", '{"number": 2}'), "Open."],
        "task 3": [call("guess", '{"number": 1}'), "I give up."],
    }
    before = len(events(log))
    trainer = hub_trainer(tmp_path, tok, factory, dataset)
    trainer.generator = TurnScriptedGenerator(tok, scripts)
    trainer.train()
    rewards = reward_logs(trainer, "VaultEnvironment")
    assert len(rewards) == 2
    # one epoch over the 4 tasks, 2 completions each: 3 of 4 tasks won -> 0.75 over the two steps
    assert sum(rewards) / 2 == pytest.approx(0.75)
    seen = events(log)[before:]
    assert sorted(e["secret"] for e in seen if e["event"] == "reset") == [2, 2, 3, 3, 4, 4, 5, 5]
    calls = sorted(
        (e["event"], e["secret"], e.get("number", e.get("kind"))) for e in seen if e["event"] != "reset"
    )
    expected = [("hint", 3, "parity"), ("guess", 3, 3), ("guess", 4, 4), ("guess", 2, 1), ("guess", 2, 2)]
    assert calls == sorted((expected + [("guess", 5, 1)]) * 2)


def test_openenv_mcp_bad_input(openenv_mcp_server, openenv_server, monkeypatch):
    from posttrain.agents.hubs import openenv_environment, openenv_hub

    mcp_url, _ = openenv_mcp_server
    # tool_name / tool_description name the one action tool; an MCP environment's tools keep their own
    with pytest.raises(ValueError, match="tool_name name and describe the one action tool"):
        openenv_environment(mcp_url, tool_name="play")
    # mcp=True on an environment whose action model is not OpenEnv's MCP action
    url, _ = openenv_server
    with pytest.raises(RuntimeError, match=rf"The OpenEnv server at {url} lists no MCP tools"):
        openenv_environment(url, mcp=True)
    # mcp=False: the MCP server's CallToolAction is the one tool
    Plain = openenv_environment(mcp_url, mcp=False)
    assert [n for n in vars(Plain) if not n.startswith("_")] == ["call_tool"]
    # an MCP tool named like a reserved method of posttrain's environments (OpenEnv reserves reset,
    # step, state and close, not get_reward)
    Tool = openenv_hub._mcp_types().Tool
    reserved = Tool(name="get_reward", description="", input_schema={"type": "object"})
    monkeypatch.setattr(openenv_hub, "list_mcp_tools", lambda *args: [reserved])
    with pytest.raises(ValueError, match="has a tool named 'get_reward', which posttrain cannot expose"):
        openenv_environment(mcp_url)


# ---------------------------------------------------------------------------------------------
# OpenReward (ORS)
# ---------------------------------------------------------------------------------------------


def test_openreward_adapter_describes_the_servers_tools(ors_server):
    from posttrain.agents.environments import environment_tools
    from posttrain.agents.hubs import openreward_environment, openreward_tasks

    url, _ = ors_server
    Echo = openreward_environment("echoenvironment", url=url, name="EchoEnv")
    env = Echo()
    tools = environment_tools(env)
    assert list(tools) == ["echo"]
    assert tools["echo"].schema["function"]["parameters"]["required"] == ["text"]
    assert env.reset(task_index=0) == "Call echo with the word 'hello'."
    assert env.get_reward() is None  # an episode without a scored call is not scored
    env.reset()  # no task_index: the split's tasks in order
    assert tools["echo"].fn(text="bye") == "wrong"
    assert tools["echo"].fn(text="hello") == "right"
    with pytest.raises(RuntimeError, match="the episode is over"):
        tools["echo"].fn(text="hello")
    assert env.get_reward() == 1.0  # and the session is closed: the episode is scored
    with pytest.raises(RuntimeError, match="no episode is running"):
        tools["echo"].fn(text="hello")
    dataset = openreward_tasks("echoenvironment", url=url)
    assert dataset.column_names == ["task_index"] and dataset["task_index"] == [0]


def test_openreward_grpo_training_against_a_local_server(tmp_path, ors_server):
    from posttrain.agents.hubs import openreward_environment, openreward_tasks

    url, log = ors_server
    tok = qwen_tokenizer()
    factory = openreward_environment("echoenvironment", url=url, name="EchoEnv")
    dataset = openreward_tasks("echoenvironment", url=url)  # one task: its prompt comes from the server
    # a miss (reward 0.0) then a hit (reward 1.0, finished): the episode's reward is the last one
    scripts = {
        "echo with the word": [call("echo", '{"text": "bye"}'), call("echo", '{"text": "hello"}'), "Done."]
    }
    before = len(events(log))
    trainer = hub_trainer(tmp_path, tok, factory, dataset, per_device_train_batch_size=2)
    trainer.generator = TurnScriptedGenerator(tok, scripts)
    trainer.train()
    assert reward_logs(trainer, "EchoEnv") == [1.0, 1.0]
    seen = events(log)[before:]
    # 2 steps x 2 episodes x 2 calls reached the server; the episodes of a turn run side by side
    assert sorted((e["text"], e["reward"]) for e in seen) == [("bye", 0.0)] * 4 + [("hello", 1.0)] * 4


def test_openreward_spec_gives_the_references_three_arguments(ors_server):
    from posttrain.agents.environments import environment_tools
    from posttrain.agents.hubs import OpenRewardSpec, outcome_reward

    url, _ = ors_server
    spec = OpenRewardSpec(url)  # a URL: the server's environment is found by itself
    data = spec.train_dataset
    assert data.column_names == ["prompt", "task_index", "word"]  # the task's own fields as columns
    assert data[0] == {"prompt": [{"role": "user", "content": ""}], "task_index": 0, "word": "hello"}
    env = spec.environment_factory()
    assert list(environment_tools(env)) == ["echo"]
    assert not hasattr(env, "get_reward")  # scored by reward_funcs only, never twice
    assert spec.reward_funcs is outcome_reward
    assert env.reset(task_index=0) == "Call echo with the word 'hello'."
    assert outcome_reward([env]) == [None]  # no tool scored the episode: not a scored zero
    env.reset(task_index=0)
    env.echo(text="bye")
    env.echo(text="hello")
    assert env.rewards == [0.0, 1.0] and outcome_reward([env]) == [1.0]
    assert OpenRewardSpec(url, include_metadata=False).train_dataset.column_names == ["prompt", "task_index"]
    assert OpenRewardSpec(url, indices=[0]).train_dataset["task_index"] == [0]
    with pytest.raises(ValueError, match="both num_tasks and indices"):
        OpenRewardSpec(url, num_tasks=1, indices=[0])
    with pytest.raises(ValueError, match=r"indices \[3\] are outside split 'train', which has 1 task"):
        _ = OpenRewardSpec(url, indices=[3]).train_dataset
    with pytest.raises(ValueError, match="num_tasks=0 is invalid"):
        OpenRewardSpec(url, num_tasks=0)


def test_openreward_spec_trains_grpo_as_a_reference_script_does(tmp_path, ors_server):
    from posttrain import GRPOTrainer
    from posttrain.agents.hubs import OpenRewardSpec

    url, log = ors_server
    tok = qwen_tokenizer()
    spec = OpenRewardSpec(url, num_tasks=1)
    scripts = {
        "echo with the word": [call("echo", '{"text": "bye"}'), call("echo", '{"text": "hello"}'), "Done."]
    }
    model = build_tiny_model(tok)
    model.config.max_position_embeddings = 4096
    before = len(events(log))
    trainer = GRPOTrainer(
        model=model,
        args=make_config(
            tmp_path, num_generations=2, max_steps=2, max_completion_length=400, per_device_train_batch_size=2
        ),
        train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
        reward_funcs=spec.reward_funcs,
        processing_class=tok,
    )
    trainer.generator = TurnScriptedGenerator(tok, scripts)
    trainer.train()
    assert reward_logs(trainer, "outcome_reward") == [1.0, 1.0]
    reward_keys = {
        k for e in trainer.state.log_history for k in e if k.startswith("rewards/") and k.endswith("/mean")
    }
    assert reward_keys == {"rewards/outcome_reward/mean"}  # the environment is not a second reward source
    assert [e["text"] for e in events(log)[before:]].count("hello") == 4


# ---------------------------------------------------------------------------------------------
# Harbor
# ---------------------------------------------------------------------------------------------


def harbor_task_tree(root: Path, image: str = "python:3.12-slim") -> Path:
    """One Harbor task, hello: write hello to /workdir/answer.txt; its verifier (bash) writes the reward."""
    task = root / "tasks" / "hello"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Write the word hello to /workdir/answer.txt.\n")
    (task / "task.toml").write_text(
        'schema_version = "1.1"\n[task]\nname = "posttrain/hello"\n[verifier]\ntimeout_sec = 60.0\n'
    )
    (task / "environment" / "Dockerfile").write_text(f"FROM {image}\nWORKDIR /workdir\n")
    (task / "tests" / "test.sh").write_text(
        '#!/bin/bash\n[ "$(cat /workdir/answer.txt)" = hello ] && echo 1 > /logs/verifier/reward.txt '
        "|| echo 0 > /logs/verifier/reward.txt\n"
    )
    return root


def docker_daemon_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


#: The base image of the real-sandbox test's task. Docker Hub is out of reach on posttrain's machines,
#: so it is a local image (docs/agents.md, Harbor: a debootstrap of Debian imported with docker import).
HARBOR_BASE_IMAGE = os.environ.get("POSTTRAIN_HARBOR_IMAGE", "local/debian:bookworm")

#: What the scripted episodes run in the sandbox: PID 1 of a Harbor docker sandbox is its keep-alive
#: command (sleep infinity), so the output shows that the command ran in the container.
HARBOR_COMMANDS = (
    "cat /proc/1/cmdline | tr '\\0' ' '; echo; echo hello > /workdir/answer.txt; cat /workdir/answer.txt",
    "cat /proc/1/cmdline | tr '\\0' ' '; echo; echo bye > /workdir/answer.txt; cat /workdir/answer.txt",
)


class AlternatingBash:
    """A scripted generator for Harbor's one task: on an episode's first turn, row i of the batch
    calls ``bash`` with ``HARBOR_COMMANDS[i % 2]`` (the right answer, then a wrong one, so each group
    of 2 has rewards 1 and 0); later turns answer "Done."."""

    def __init__(self, tokenizer, marker: str = "<|im_start|>assistant"):
        self.tokenizer = tokenizer
        self.marker = marker
        self.inputs: list[str] = []

    def generate(self, prompt_ids, prompt_mask, **kwargs):
        from posttrain.generation.base import Samples

        eos = self.tokenizer.eos_token_id
        rows = []
        for i, (ids, mask) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True)):
            text = self.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
            self.inputs.append(text)
            first = text.count(self.marker) == 1
            reply = call("bash", json.dumps({"command": HARBOR_COMMANDS[i % 2]})) if first else "Done."
            rows.append(self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos])
        return Samples.from_lists(rows, self.tokenizer.pad_token_id or eos, prompt_ids.device)

    def tool_outputs(self) -> list[str]:
        return [
            text.split("<tool_response>")[-1].split("</tool_response>")[0].strip()
            for text in self.inputs
            if "<tool_response>" in text
        ]


def running_containers() -> set[str]:
    out = subprocess.run(["docker", "ps", "-q"], capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


def test_harbor_up_to_the_sandbox_boundary(tmp_path):
    """Every Harbor sandbox backend is a container, VM or cloud sandbox (harbor 0.26: docker, podman,
    e2b, daytona, modal, ...; none runs on the host without a daemon). Without a Docker daemon the
    test reads the task tree through Harbor and checks that the adapter stops at Harbor's preflight,
    before any trainer is built."""
    pytest.importorskip("harbor")
    from posttrain.agents.hubs import harbor_environment, harbor_tasks

    dataset = harbor_tasks(harbor_task_tree(tmp_path))
    assert dataset["task_name"] == ["hello"]
    assert Path(dataset["task_dir"][0]).name == "hello"
    if docker_daemon_runs():
        pytest.skip("a Docker daemon runs here: this test covers the no-daemon boundary only")
    with pytest.raises(RuntimeError, match="Harbor's sandbox backend 'docker' cannot run here"):
        harbor_environment(environment_type="docker")


def test_harbor_grpo_training_in_a_docker_sandbox(tmp_path):
    """Where a Docker daemon runs (with ``docker compose``), ``harbor`` is installed and the local
    base image exists: 2 GRPO steps on the Harbor task, each episode in its own container that
    Harbor builds and starts, the reward from the verifier run in it. Elsewhere (CI: Python 3.11,
    no daemon) it skips."""
    pytest.importorskip("harbor")
    if not docker_daemon_runs():
        pytest.skip("no Docker daemon runs here (see test_harbor_up_to_the_sandbox_boundary)")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode:
        pytest.skip("Harbor's docker backend runs `docker compose`, which is not installed here")
    if subprocess.run(
        ["docker", "image", "inspect", HARBOR_BASE_IMAGE], capture_output=True, timeout=30
    ).returncode:
        pytest.skip(f"no local image {HARBOR_BASE_IMAGE} (POSTTRAIN_HARBOR_IMAGE): docs/agents.md, Harbor")
    from posttrain.agents.hubs import harbor_environment, harbor_tasks

    before = running_containers()
    tok = qwen_tokenizer()
    Env = harbor_environment(environment_type="docker")
    dataset = harbor_tasks(harbor_task_tree(tmp_path, image=HARBOR_BASE_IMAGE))
    trainer = hub_trainer(tmp_path / "out", tok, Env, dataset, per_device_train_batch_size=2)
    script = AlternatingBash(tok)
    trainer.generator = script
    trainer.train()
    # each step: one episode wrote hello (the verifier's 1.0), the other bye (0.0)
    assert reward_logs(trainer, "HarborEnvironment") == [0.5, 0.5]
    assert script.tool_outputs() == ["sh -c sleep infinity \nhello", "sh -c sleep infinity \nbye"] * 2
    assert running_containers() <= before  # every episode's sandbox stopped once it was scored


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "modules, adapter, extra",
    [
        (("openenv", "openenv.core"), "openenv_environment", "openenv"),
        (("openreward",), "openreward_environment", "openreward"),
        (("harbor",), "harbor_environment", "harbor"),
    ],
    ids=["openenv", "openreward", "harbor"],
)
def test_missing_hub_package_names_the_extra(monkeypatch, modules, adapter, extra):
    import posttrain.agents.hubs as hubs

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    args = {"openenv_environment": ("http://127.0.0.1:1",), "openreward_environment": ("env",)}.get(
        adapter, ()
    )
    with pytest.raises(ImportError, match=rf'pip install "posttrain\[{extra}\]"'):
        getattr(hubs, adapter)(*args)


@pytest.mark.parametrize("hub", ["openenv", "openenv-mcp", "openreward"])
def test_unreachable_server_names_host_port_and_timeout(hub):
    from posttrain.agents import hubs

    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    if hub == "openenv":
        pytest.importorskip("openenv.core")
        make = lambda: hubs.openenv_environment(url, timeout=0.5)  # noqa: E731
    elif hub == "openenv-mcp":
        pytest.importorskip("openenv.core")
        make = lambda: hubs.openenv_environment(url, timeout=0.5, mcp=True)  # noqa: E731
    else:
        pytest.importorskip("openreward")
        make = lambda: hubs.openreward_environment("echoenvironment", url=url, timeout=0.5)  # noqa: E731
    with pytest.raises(
        ConnectionError,
        match=rf"unreachable: no connection to host 127\.0\.0\.1, port {port} within the timeout of 0\.5 s",
    ):
        make()


def test_remote_tool_schema_is_kept_and_its_arguments_checked():
    """A tool made from a remote JSON schema shows the model that schema as it is, and a call with a
    wrong argument fails as bad_arguments before anything reaches the server."""
    from posttrain.agents.hubs._common import tool_method
    from posttrain.agents.tools import Tool, run_tool_calls, tool_schema
    from posttrain.agents.types import ToolCall

    sent = []
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "enum": ["a", "b"]}},
        "required": ["word"],
    }
    method = tool_method("say", "Say a word.", schema, lambda self, name, args: sent.append(args) or "ok")
    assert tool_schema(method)["function"]["parameters"] == schema
    tool = Tool("say", method.__get__(object()), tool_schema(method), False)
    good, bad = ToolCall("say", {"word": "a"}), ToolCall("say", {"wrd": "a"})
    results = run_tool_calls([[good, bad]], [{"say": tool}])[0]
    assert [r.failure for r in results] == [None, "bad_arguments"]
    assert sent == [{"word": "a"}]


def test_remote_tool_named_like_a_reserved_method_is_refused():
    from posttrain.agents.hubs._common import check_tool_name

    with pytest.raises(ValueError, match="has a tool named 'reset', which posttrain cannot expose"):
        check_tool_name("reset", "OpenReward", {})
