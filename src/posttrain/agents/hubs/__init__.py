"""Environment hubs as ``environment_factory`` classes: thin adapters over each hub's own client.

- ``openenv_environment(base_url)``: an OpenEnv server, its action as a tool, or an MCP
  environment's tools (``pip install "posttrain[openenv]"``).
- ``openreward_environment(name, url=...)`` and ``openreward_tasks``: an ORS server or the
  OpenReward catalog (``pip install "posttrain[openreward]"``); ``OpenRewardSpec(target)``, the
  reference's one-object form of the same (``train_dataset``, ``environment_factory``,
  ``reward_funcs``).
- ``harbor_environment()`` and ``harbor_tasks(path)``: a Harbor task tree run in Harbor's
  sandboxes (``pip install "posttrain[harbor]"``, Python >= 3.12).

Each returns a class whose instances are the rollout slots' environments: ``reset`` starts an
episode and returns its first text, the hub's actions are the tools, and ``get_reward`` gives the
hub's reward, logged as ``rewards/{ClassName}/mean``. The names load lazily; the hub packages are
imported only when an adapter is used. See ``docs/agents.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "openenv_environment": "posttrain.agents.hubs.openenv_hub",
    "openreward_environment": "posttrain.agents.hubs.openreward_hub",
    "openreward_tasks": "posttrain.agents.hubs.openreward_hub",
    "OpenRewardSpec": "posttrain.agents.hubs.openreward_hub",
    "outcome_reward": "posttrain.agents.hubs.openreward_hub",
    "harbor_environment": "posttrain.agents.hubs.harbor_hub",
    "harbor_tasks": "posttrain.agents.hubs.harbor_hub",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
