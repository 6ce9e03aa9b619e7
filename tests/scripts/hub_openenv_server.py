"""A real OpenEnv server for tests/test_env_hubs.py: a number-guessing text game.

Usage: python hub_openenv_server.py PORT LOG. Served by openenv-core's own app (``create_fastapi_app``)
under uvicorn on 127.0.0.1:PORT, 8 sessions at most; every reset and step is appended to LOG as a JSON
line, so the test can check what the server saw.
"""

from __future__ import annotations

import json
import sys

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LOG = sys.argv[2] if len(sys.argv) > 2 else None


def record(**event) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(event) + "\n")


class GuessAction(Action):
    """Guess the secret number."""

    number: int = Field(..., description="The number to guess, from 1 to 5.")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the game answers.")


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.secret = 3

    def reset(
        self, secret: int = 3, seed: int | None = None, episode_id: str | None = None
    ) -> GuessObservation:
        self.secret = int(secret)
        self._state = State(step_count=0)
        record(event="reset", secret=self.secret)
        return GuessObservation(message="Guess the secret number, from 1 to 5.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        record(event="step", number=action.number, secret=self.secret)
        if action.number == self.secret:
            return GuessObservation(message="Correct!", done=True, reward=1.0)
        hint = "higher" if action.number < self.secret else "lower"
        return GuessObservation(message=f"Wrong: go {hint}.", done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
