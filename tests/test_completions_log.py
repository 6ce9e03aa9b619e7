"""CompletionLog: the completions file (format, appending) and the rich table."""

from __future__ import annotations

import io
import json
import math

import pytest

from posttrain.observe.completions import (
    COMPLETIONS_FILE,
    FIXED_KEYS,
    CompletionLog,
    extra_key,
    flat_records,
    read_completions,
    render_messages,
)

Console = pytest.importorskip("rich.console").Console


def _chat(prompt_text: str, answer: str) -> tuple[list[dict], list[dict]]:
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": prompt_text},
    ]
    return prompt, [{"role": "assistant", "content": answer}]


def _add_text(log: CompletionLog, step: int = 3, n_prompts: int = 2, group: int = 2) -> None:
    prompts = [f"prompt {p}" for p in range(n_prompts) for _ in range(group)]
    completions = [f"answer {i}" for i in range(len(prompts))]
    log.add(
        step,
        prompts,
        completions,
        rewards={"accuracy": [float(i % 2) for i in range(len(prompts))], "format": [0.5] * len(prompts)},
        advantages=[0.25 * i for i in range(len(prompts))],
        extra={"len": list(range(len(prompts)))},
    )


def _raw_lines(tmp_path) -> list[str]:
    return (tmp_path / COMPLETIONS_FILE).read_text(encoding="utf-8").splitlines()


def _cells(table, header: str) -> list[str]:
    column = next(c for c in table.columns if c.header == header)
    return [str(c) for c in column.cells]


# ---- file --------------------------------------------------------------------------------------


def test_text_rows_round_trip(tmp_path):
    log = CompletionLog()
    log.add(
        7,
        ["p0", "p1"],
        ["c0", "c1"],
        rewards={"acc": [1.0, None], "fmt": [float("nan"), 0.5]},
        advantages=[0.5, -0.5],
        extra={"difficulty": ["easy", "hard"], "tokens": [3, 4]},
    )
    assert log.flush_to_file(tmp_path) == 2
    assert log.rows == []
    lines = _raw_lines(tmp_path)
    assert len(lines) == 2
    assert "NaN" not in lines[0] and "null" in lines[0] and "null" in lines[1]
    first, second = (json.loads(line) for line in lines)
    assert first == {
        "step": 7,
        "prompt": "p0",
        "completion": "c0",
        "rewards": {"acc": 1.0, "fmt": None},
        "advantage": 0.5,
        "difficulty": "easy",
        "tokens": 3,
    }
    assert second["rewards"] == {"acc": None, "fmt": 0.5}
    assert list(first)[:5] == list(FIXED_KEYS)
    assert read_completions(tmp_path) == [first, second]


def test_message_rows_keep_their_structure(tmp_path):
    prompt, completion = _chat("What is 2+2?", "4")
    log = CompletionLog()
    log.add(1, [prompt], [completion], rewards={"acc": [1.0]}, advantages=[0.0], extra={})
    log.flush_to_file(tmp_path)
    (row,) = read_completions(tmp_path / COMPLETIONS_FILE)
    assert row["prompt"] == prompt
    assert row["completion"] == completion
    assert row["advantage"] == 0.0


def test_colliding_extra_names_are_prefixed(tmp_path):
    log = CompletionLog()
    log.add(
        2,
        ["p"],
        ["c"],
        rewards={"r": [1.0]},
        advantages=[1.0],
        extra={"step": [99], "advantage": ["x"], "prompt": ["y"], "extra/step": [5], "other": [None]},
    )
    log.flush_to_file(tmp_path)
    (row,) = read_completions(tmp_path)
    assert row["step"] == 2 and row["advantage"] == 1.0 and row["prompt"] == "p"
    assert row["extra/step"] == 99
    assert row["extra/advantage"] == "x"
    assert row["extra/prompt"] == "y"
    assert row["extra/extra/step"] == 5  # the user's own "extra/step" does not overwrite the prefixed one
    assert row["other"] is None
    assert extra_key("rewards") == "extra/rewards"
    assert extra_key("length") == "length"


def test_flushes_append_and_lose_nothing(tmp_path):
    log = CompletionLog()
    _add_text(log, step=1)  # 4 rows
    assert log.flush_to_file(tmp_path) == 4
    _add_text(log, step=2)
    _add_text(log, step=3)
    log.print_table(console=Console(file=io.StringIO()))  # display does not touch the file buffer
    assert len(log.rows) == 8
    assert log.flush_to_file(tmp_path) == 8
    assert log.flush_to_file(tmp_path) == 0  # nothing new: nothing written
    rows = read_completions(tmp_path)
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 4
    assert [r["completion"] for r in rows] == [f"answer {i}" for i in range(4)] * 3


def test_flush_to_explicit_file_and_new_directory(tmp_path):
    log = CompletionLog()
    _add_text(log)
    log.flush_to_file(tmp_path / "run" / "out")  # created
    assert len(read_completions(tmp_path / "run" / "out")) == 4
    _add_text(log)
    target = tmp_path / "eval_completions.jsonl"
    log.flush_to_file(target)
    assert len(read_completions(target)) == 4


def test_non_main_process_keeps_and_writes_nothing(tmp_path):
    log = CompletionLog(is_main_process=False)
    _add_text(log)
    assert log.rows == []
    assert log.flush_to_file(tmp_path) == 0
    assert not (tmp_path / COMPLETIONS_FILE).exists()
    assert log.print_table(console=Console(file=io.StringIO())) is False
    assert log.table().row_count == 0


def test_mismatched_lengths_are_rejected():
    log = CompletionLog()
    with pytest.raises(ValueError, match="advantages"):
        log.add(0, ["a", "b"], ["x", "y"], rewards={"r": [1.0, 0.0]}, advantages=[1.0])
    with pytest.raises(ValueError, match="extra"):
        log.add(0, ["a", "b"], ["x", "y"], rewards={"r": [1.0, 0.0]}, advantages=[1.0, 0.0], extra={"e": [1]})
    assert log.rows == []


def test_add_rows_feeds_gathered_rows(tmp_path):
    """Rows built on each process can be gathered and added on the main process."""
    worker = CompletionLog()
    _add_text(worker, step=4)
    gathered = worker.rows + [
        {"step": 4, "prompt": "q", "completion": "a", "rewards": {"acc": math.nan}, "advantage": math.inf}
    ]
    main = CompletionLog()
    main.add_rows(gathered)
    main.flush_to_file(tmp_path)
    rows = read_completions(tmp_path)
    assert len(rows) == 5
    assert rows[-1]["rewards"] == {"acc": None} and rows[-1]["advantage"] is None
    with pytest.raises(ValueError, match="lacks"):
        main.add_rows([{"step": 1, "prompt": "p"}])


# ---- table -------------------------------------------------------------------------------------


def test_table_columns_and_rows():
    log = CompletionLog()
    _add_text(log, step=5)
    table = log.table()
    headers = [c.header for c in table.columns]
    assert headers == ["step", "prompt", "completion", "accuracy", "format", "advantage", "len"]
    assert table.row_count == 4
    assert _cells(table, "step") == ["5"] * 4
    assert _cells(table, "accuracy") == ["0.000", "1.000", "0.000", "1.000"]
    assert _cells(table, "advantage") == ["0.000", "0.250", "0.500", "0.750"]
    assert _cells(table, "len") == ["0", "1", "2", "3"]
    # the display buffer is cleared; the file buffer is not
    assert log.table().row_count == 0
    assert len(log.rows) == 4


def test_table_honours_num_to_print():
    log = CompletionLog()
    _add_text(log, n_prompts=5, group=4)  # 20 rows
    table = log.table(num_to_print=3, seed=0)
    assert table.row_count == 3
    completions = _cells(table, "completion")
    indices = [int(c.split()[1]) for c in completions]
    assert indices == sorted(indices)  # drawn rows stay in order
    _add_text(log, n_prompts=1, group=2)
    assert log.table(num_to_print=10).row_count == 2  # more than there are: all
    _add_text(log, n_prompts=1, group=2)
    assert log.table(num_to_print=0).row_count == 0


def test_table_honours_unique_prompts():
    log = CompletionLog()
    _add_text(log, n_prompts=3, group=4)  # 12 rows, 3 prompts
    table = log.table(unique_prompts=True)
    assert table.row_count == 3
    assert _cells(table, "prompt") == ["prompt 0", "prompt 1", "prompt 2"]
    assert _cells(table, "completion") == ["answer 0", "answer 4", "answer 8"]
    _add_text(log, n_prompts=3, group=4)
    assert log.table(num_to_print=2, unique_prompts=True).row_count == 2


def test_unique_prompts_with_messages():
    log = CompletionLog()
    p0, c0 = _chat("one", "1")
    p1, c1 = _chat("two", "2")
    log.add(0, [p0, p0, p1], [c0, c0, c1], rewards={}, advantages=[0.0, 0.0, 0.0])
    assert log.table(unique_prompts=True).row_count == 2


def test_messages_render_as_role_lines():
    prompt, completion = _chat("What is 2+2?", "4")
    assert render_messages(prompt) == "system: Be brief.\nuser: What is 2+2?"
    assert render_messages(completion) == "assistant: 4"
    assert render_messages("plain") == "plain"
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert render_messages(parts) == "user: <image> What is this?"
    log = CompletionLog()
    log.add(0, [prompt], [completion], rewards={"r": [1.0]}, advantages=[0.0])
    table = log.table()
    assert _cells(table, "prompt") == ["system: Be brief.\nuser: What is 2+2?"]
    assert _cells(table, "completion") == ["assistant: 4"]


def test_missing_rewards_show_a_dash():
    log = CompletionLog()
    log.add(
        0,
        ["a", "b", "c"],
        ["x", "y", "z"],
        rewards={"r": [float("nan"), None, 2.0]},
        advantages=[float("nan"), 0.0, 1.0],
        extra={"note": [None, "ok", 1.5]},
    )
    table = log.table()
    assert _cells(table, "r") == ["—", "—", "2.000"]
    assert _cells(table, "advantage") == ["—", "0.000", "1.000"]
    assert _cells(table, "note") == ["—", "ok", "1.500"]


def test_rows_with_different_rewards_share_one_table():
    log = CompletionLog()
    log.add(1, ["a"], ["x"], rewards={"r1": [1.0]}, advantages=[0.0])
    log.add(2, ["b"], ["y"], rewards={"r2": [2.0]}, advantages=[0.0], extra={"e": [1]})
    table = log.table()
    assert [c.header for c in table.columns] == ["step", "prompt", "completion", "r1", "r2", "advantage", "e"]
    assert _cells(table, "r1") == ["1.000", "—"]
    assert _cells(table, "r2") == ["—", "2.000"]
    assert _cells(table, "e") == ["—", "1"]
    assert table.title == "Completions, steps 1-2"


def test_print_table_prints():
    log = CompletionLog()
    _add_text(log, step=9)
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert log.print_table(num_to_print=2, console=console) is True
    text = out.getvalue()
    assert "accuracy" in text and "advantage" in text and "step 9" in text
    assert log.print_table(console=console) is False  # nothing new


def test_brackets_are_not_rich_markup():
    log = CompletionLog()
    log.add(0, ["[bold]x[/bold] [/]"], ["[red]y"], rewards={"r": [1.0]}, advantages=[0.0])
    out = io.StringIO()
    assert log.print_table(console=Console(file=out, width=200)) is True
    assert "[bold]x[/bold] [/]" in out.getvalue() and "[red]y" in out.getvalue()


def test_display_limit_keeps_the_latest_rows_but_the_file_gets_all(tmp_path):
    log = CompletionLog(display_limit=3)
    _add_text(log, step=1)  # 4 rows
    _add_text(log, step=2)  # 4 rows
    table = log.table()
    assert table.row_count == 3
    assert _cells(table, "step") == ["2", "2", "2"]
    assert _cells(table, "completion") == ["answer 1", "answer 2", "answer 3"]
    assert log.flush_to_file(tmp_path) == 8


def test_flat_records_for_tables():
    log = CompletionLog()
    prompt, completion = _chat("hi", "hello")
    log.add(
        4,
        [prompt, prompt],
        [completion, completion],
        rewards={"acc": [1.0, None], "prompt": [0.0, 0.0]},
        advantages=[0.5, -0.5],
        extra={"len": [2, 3], "step": [9, 9]},
    )
    records = flat_records(log.rows)
    assert records[0] == {
        "step": 4,
        "prompt": "system: Be brief.\nuser: hi",
        "completion": "assistant: hello",
        "acc": 1.0,
        "rewards/prompt": 0.0,
        "advantage": 0.5,
        "len": 2,
        "extra/step": 9,
    }
    assert records[1]["acc"] is None
    assert len(flat_records(log.rows, unique_prompts=True)) == 1


def test_trainer_writes_every_completion_with_rewards_and_extras(tmp_path, capsys):
    """log_completions: a table at each logging step and every row in completions.jsonl."""
    from conftest import build_tiny_model, build_tiny_tokenizer
    from helpers import make_config, standard_dataset

    from posttrain import GRPOTrainer
    from posttrain.observe.completions import read_completions

    def reward(completion_ids, log_extra, log_metric, **kwargs):
        log_extra("n_tokens", [len(ids) for ids in completion_ids])
        log_metric("my_metric", 0.5)
        return [float(len(ids) % 3) for ids in completion_ids]

    tok = build_tiny_tokenizer()
    trainer = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=reward,
        args=make_config(tmp_path, max_steps=3, log_completions=True, num_completions_to_print=2),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.train()
    rows = read_completions(tmp_path / "completions.jsonl")
    assert len(rows) == 12  # 3 steps x 4 completions, none lost
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(set(r["rewards"]) == {"reward"} and "n_tokens" in r and "advantage" in r for r in rows)
    printed = capsys.readouterr().out
    assert "completion" in printed.lower() and "n_tok" in printed  # the log_extra column is in the table
    assert all(
        h["my_metric"] == 0.5 for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h
    )


def test_images_of_image_blocks_are_saved_once_as_png_files_next_to_the_file(tmp_path):
    import numpy as np
    from PIL import Image

    pixels = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    image, other = Image.fromarray(pixels), Image.fromarray(255 - pixels)
    prompt = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Count."}]}
    ]
    tool = {
        "role": "tool",
        "name": "look",
        "content": [{"type": "image", "image": other}, {"type": "text", "text": "ok"}],
    }
    completion = [{"role": "assistant", "content": "call"}, tool, {"role": "assistant", "content": "Two."}]
    log = CompletionLog(image_folder=str(tmp_path / "completion_images"))
    log.add(1, [prompt, prompt], [completion, completion], {"r": [1.0, 0.0]}, [0.5, -0.5])
    log.flush_to_file(tmp_path)
    rows = read_completions(tmp_path)
    paths = [rows[0]["prompt"][0]["content"][0]["image"], rows[0]["completion"][1]["content"][0]["image"]]
    assert all(p.startswith("completion_images/") and p.endswith(".png") for p in paths)
    assert rows[1]["prompt"][0]["content"][0]["image"] == paths[0]  # the same image: one file
    assert sorted(f.name for f in (tmp_path / "completion_images").iterdir()) == sorted(
        p.split("/")[1] for p in paths
    )
    for path, original in zip(paths, (image, other), strict=True):
        assert np.array_equal(np.asarray(Image.open(tmp_path / path)), np.asarray(original))
    assert "<image> Count." in render_messages(rows[0]["prompt"])

    dropped = CompletionLog()  # log_multimodal=False: the blocks stay, their images are left out
    dropped.add(1, [prompt], [completion], {"r": [1.0]}, [0.0])
    dropped.flush_to_file(tmp_path / "text_only.jsonl")
    (row,) = read_completions(tmp_path / "text_only.jsonl")
    assert row["prompt"][0]["content"][0] == {"type": "image"} and row["completion"][1]["content"][0] == {
        "type": "image"
    }
    assert prompt[0]["content"][0]["image"] is image  # the caller's messages are not changed
