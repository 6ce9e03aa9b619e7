"""A real OpenEnv MCP environment for tests/test_env_hubs.py: a number-guessing game whose moves are MCP
tools.

Usage: python hub_openenv_mcp_server.py PORT LOG. The environment is openenv-core's ``MCPEnvironment``
with four FastMCP tools: ``guess(number)``, ``hint(kind)``, ``picture()`` (a text and a PNG image) and
``fail()`` (raises). It rewards each tool call (1.0 once the secret is guessed, which ends the
episode, else 0.0) by setting the reward of the step's observation. Served by openenv-core's own app (``create_fastapi_app`` with its ``CallToolAction`` /
``CallToolObservation``) under uvicorn on 127.0.0.1:PORT, 8 sessions at most; every reset and tool
call is appended to LOG as a JSON line, so the test can check what the server saw.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Literal

from fastmcp import FastMCP
from fastmcp.utilities.types import Image
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State
from PIL import Image as PILImage
from pydantic import Field

LOG = sys.argv[2] if len(sys.argv) > 2 else None


def record(**event) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(event) + "\n")


class VaultObservation(Observation):
    message: str = Field(default="", description="What the game says.")


class VaultEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("vault")
        self.secret, self.solved = 3, False
        self._state = State(step_count=0)

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the secret number, from 1 to 5."""
            record(event="guess", number=number, secret=self.secret)
            if number == self.secret:
                self.solved = True
                return "Correct!"
            return "Wrong: go higher." if number < self.secret else "Wrong: go lower."

        @mcp.tool
        def hint(kind: Literal["parity", "size"] = "parity") -> str:
            """A hint about the secret number."""
            record(event="hint", kind=kind, secret=self.secret)
            if kind == "parity":
                return "The secret is even." if self.secret % 2 == 0 else "The secret is odd."
            return "The secret is above 3." if self.secret > 3 else "The secret is at most 3."

        @mcp.tool
        def picture():  # no return annotation: FastMCP sends the blocks as content, with no output schema
            """A picture of the vault's door: a 4x2 red PNG."""
            buffer = io.BytesIO()
            PILImage.new("RGB", (4, 2), (255, 0, 0)).save(buffer, format="PNG")
            return ["The door:", Image(data=buffer.getvalue(), format="png")]

        @mcp.tool
        def fail() -> str:
            """A tool that always fails."""
            raise ValueError("the vault is jammed")

        super().__init__(mcp)

    def reset(self, secret: int = 3, seed: int | None = None, episode_id: str | None = None) -> Observation:
        self.secret, self.solved = int(secret), False
        self._state = State(step_count=0)
        record(event="reset", secret=self.secret)
        return VaultObservation(message="Open the vault: find the secret number, from 1 to 5.", reward=0.0)

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(
            done=False, reward=0.0, metadata={"error": f"unknown action {type(action).__name__}"}
        )

    async def step_async(self, action, timeout_s=None, **kwargs) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            observation.reward = 1.0 if self.solved else 0.0
            observation.done = self.solved
        return observation

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(VaultEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=8)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
