"""End to end: a tiny model taught (in a fixture) to call a tool under the Qwen2.5 template trains
with GRPO on the spec's IncrementEnv example, the dataset's "target" column reaching reset()."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from helpers import CPU_TEST_ARGS, make_config
from test_agent_loop import IncrementEnv, call, long_context_model, qwen_tokenizer

from posttrain.agents.templates import TURN_END, continuation_text
from posttrain.agents.tools import tools_from_functions
from posttrain.data.chat import render_template

CALL = call("increment", '{"step": 1}')


def dataset():
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {t}."}] for t in (1, 2)],
            "target": [1, 2],
        }
    )


def teach_tool_call(tok, model, steps: int = 200) -> None:
    """Supervised steps on [prompt | call | tool result | "Done."], loss on the model's tokens only."""
    env = IncrementEnv()
    (schema,) = [t.schema for t in tools_from_functions([env.increment])]
    specials = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    template = tok.chat_template
    rows = []
    for prompt in dataset()["prompt"]:
        prefix = render_template(template, prompt, [schema], True, **specials)
        assistant = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "increment", "arguments": {"step": 1}}}],
        }
        tool = [{"role": "tool", "name": "increment", "content": "1"}]
        middle = continuation_text(
            template, prompt + [assistant], tool, [schema], TURN_END["qwen"], **specials
        )
        pieces = [(prefix, 0), (CALL + "<|im_end|>", 1), (middle, 0), ("Done.<|im_end|>", 1)]
        ids, weights = [], []
        for text, trained in pieces:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids += piece
            weights += [trained] * len(piece)
        rows.append((torch.tensor([ids]), torch.tensor([weights[1:]], dtype=torch.float32)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    ids = torch.cat([r[0] for r in rows])  # both prompts render to the same length here
    weights = torch.cat([r[1] for r in rows])
    for _ in range(steps):
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * weights).sum() / weights.sum()
        if loss.item() < 0.01:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.01, f"the fixture model did not learn the call (loss {loss.item():.3f})"


@pytest.fixture(scope="module")
def tool_calling_model():
    torch.manual_seed(0)
    tok = qwen_tokenizer()
    model = long_context_model(tok)
    teach_tool_call(tok, model)
    return tok, model


@pytest.mark.slow
@pytest.mark.parametrize("family", ["grpo", "rloo"])
def test_increment_env_end_to_end(tmp_path, tool_calling_model, family):
    """GRPO and RLOO share the tool loop (``sampling.OnlineTrainer``); both train on environments."""
    from posttrain import GRPOTrainer, RLOOConfig, RLOOTrainer

    tok, taught = tool_calling_model
    model = copy.deepcopy(taught)  # each family trains its own copy of the fixture model
    seen = []

    def saw_environments(completions, environments, **kwargs):
        seen.append([(type(env).__name__, env.counter, env.target) for env in environments])
        return [0.0] * len(completions)

    values = {
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_steps": 2,
        "max_completion_length": 96,
        "temperature": 0.3,
        "learning_rate": 1e-5,
    }
    if family == "rloo":  # the same values in RLOO's config (beta=0.05: with a reference copy)
        args = RLOOConfig(output_dir=str(tmp_path), **{**CPU_TEST_ARGS, **values})
    else:
        args = make_config(tmp_path, **values)
    trainer_class = RLOOTrainer if family == "rloo" else GRPOTrainer
    trainer = trainer_class(
        model=model,
        reward_funcs=saw_environments,
        args=args,
        train_dataset=dataset(),
        processing_class=tok,
        environment_factory=IncrementEnv,
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "rewards/IncrementEnv/mean" in e]
    assert len(logs) == 2
    # the taught call (step 1) reaches target 1 and misses target 2: half the rows score 1
    assert [e["rewards/IncrementEnv/mean"] for e in logs] == [0.5, 0.5]
    assert all(e["tools/call_frequency"] == 1.0 and e["tools/failure_frequency"] == 0.0 for e in logs)
    assert len(seen) == 2
    for batch in seen:
        assert {name for name, _, _ in batch} == {"IncrementEnv"}
        assert sorted((counter, target) for _, counter, target in batch) == [(1, 1), (1, 1), (1, 2), (1, 2)]
