"""A real ORS server for tests/test_env_hubs.py, built with the openreward SDK: one task, one tool.

Usage: python hub_ors_server.py PORT LOG. The task asks the model to echo a word; the ``echo`` tool
rewards 1.0 and finishes the episode when the text is the word, 0.0 otherwise. Served by the SDK's own
``Server`` on 127.0.0.1:PORT; every tool call is appended to LOG as a JSON line.
"""

from __future__ import annotations

import json
import sys

from openreward.environments import Environment, JSONObject, Server, TextBlock, ToolOutput, tool
from pydantic import BaseModel

LOG = sys.argv[2] if len(sys.argv) > 2 else None


class EchoTask(BaseModel):
    word: str


class EchoParams(BaseModel):
    text: str


class EchoEnvironment(Environment):
    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}) -> None:  # noqa: B006 - the SDK's signature
        super().__init__(task_spec)
        self.task = EchoTask.model_validate(task_spec)

    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train"]

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        return [{"word": "hello"}]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(type="text", text=f"Call echo with the word '{self.task.word}'.")]

    @tool
    async def echo(self, params: EchoParams) -> ToolOutput:
        """Echo a text back; it wins when it is the task's word.

        Args:
            text: The text to echo.
        """
        right = params.text == self.task.word
        if LOG:
            with open(LOG, "a") as f:
                f.write(json.dumps({"tool": "echo", "text": params.text, "reward": float(right)}) + "\n")
        return ToolOutput(
            blocks=[TextBlock(type="text", text="right" if right else "wrong")],
            reward=1.0 if right else 0.0,
            finished=right,
        )


if __name__ == "__main__":
    Server([EchoEnvironment]).run(host="127.0.0.1", port=int(sys.argv[1]))
