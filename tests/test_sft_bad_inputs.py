"""Bad input to the SFT trainer: each gives a clear error (or a counted warning) before any training step.

Every test here is cited by docs/errors.md. The row-level checks of ``data/sft.py`` are tested there
function by function (tests/test_sft_data.py); here they are also driven through ``SFTTrainer`` with a
``datasets.Dataset``, so the row index the message names is the dataset's and the error leaves
``Dataset.map`` as it was raised.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset, IterableDataset
from helpers import CPU_TEST_ARGS

from posttrain import SFTConfig, SFTTrainer
from posttrain.data import chat, packing
from posttrain.data.sft import prepare_dataset, tokenize_row, truncate
from posttrain.ops import sac
from posttrain.sft import losses
from posttrain.sft.bema import BEMACallback

USER = {"role": "user", "content": "What is 2 + 3?"}
ASSISTANT = {"role": "assistant", "content": "<answer>5</answer>"}
#: A template of no family posttrain has a marked template for, without generation markers.
PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
NO_MODEL = "no/such-model-is-loaded"


@pytest.fixture
def tok():
    return build_tiny_tokenizer()


def config(tmp_path, **overrides) -> SFTConfig:
    return SFTConfig(**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides})


def trainer(tmp_path, tok, dataset, model=None, **kwargs) -> SFTTrainer:
    args = kwargs.pop("args", None) or config(tmp_path, **kwargs.pop("config", {}))
    return SFTTrainer(
        model=model if model is not None else build_tiny_model(tok),
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        **kwargs,
    )


def chats(*rows) -> Dataset:
    return Dataset.from_dict({"messages": list(rows)})


# ---- SFTConfig ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        pytest.param(
            {"max_length": 0}, "max_length=0 is invalid: it must be None or a positive", id="max_length"
        ),
        pytest.param(
            {"truncation_mode": "middle"}, "truncation_mode='middle' is invalid", id="truncation_mode"
        ),
        pytest.param(
            {"packing_strategy": "best"}, "packing_strategy='best' is invalid", id="packing_strategy"
        ),
        pytest.param(
            {"loss_type": "mse"}, "loss_type='mse' is invalid: it must be one of 'nll'", id="loss_type"
        ),
        pytest.param({"dataset_num_proc": 0}, "dataset_num_proc=0 is invalid", id="dataset_num_proc"),
        pytest.param(
            {"dataset_kwargs": {"add_special_tokens": False}},
            "dataset_kwargs={'add_special_tokens': False} is invalid: it must be None or a dict whose only key",
            id="dataset_kwargs",
        ),
        pytest.param(
            {"dataset_kwargs": '{"skip_prepare": true}'},
            "only key is 'skip_prepare_dataset'",
            id="dataset_kwargs-json",
        ),
        pytest.param({"pad_to_multiple_of": 0}, "pad_to_multiple_of=0 is invalid", id="pad_to_multiple_of"),
        pytest.param(
            {"router_aux_loss_coef": "high"},
            "router_aux_loss_coef='high' is invalid",
            id="router_aux_loss_coef",
        ),
    ],
)
def test_sft_config_rules_name_the_parameter_and_the_fix(tmp_path, overrides, needle):
    with pytest.raises(ValueError) as err:
        config(tmp_path, **overrides)
    assert needle in str(err.value)
    name = next(iter(overrides))
    assert (
        f"; set {name}" in str(err.value)
        or "use one of the listed values" in str(err.value)
        or ("pass dataset_kwargs={'skip_prepare_dataset': True}" in str(err.value))
    )


def test_packing_without_max_length_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match=r"packing=True fills rows of max_length tokens, but max_length=None; set max"
    ):
        config(tmp_path, packing=True, max_length=None)


def test_unknown_strategy_and_loss_names_outside_the_config():
    with pytest.raises(ValueError, match=r"packing_strategy='best' is not supported; use one of \['bfd'"):
        packing.pack([{"input_ids": [1, 2], "loss_mask": [0, 1]}], 4, "best")
    with pytest.raises(ValueError, match=r"loss_type='mse' is not supported; use one of \['nll', 'dft'"):
        losses.resolve_loss_type("mse")


# ---- datasets, before the model loads --------------------------------------------------------------


def _stream():
    yield {"text": "a"}


@pytest.mark.parametrize(
    ("train", "eval_", "needle"),
    [
        pytest.param(None, None, "SFTTrainer needs a train_dataset (text, messages", id="no-train-dataset"),
        pytest.param(
            Dataset.from_dict({"text": []}), None, "train_dataset is empty; pass a dataset", id="empty"
        ),
        pytest.param(
            Dataset.from_dict({"text": ["a"]}),
            Dataset.from_dict({"text": []}),
            "eval_dataset is empty; pass a dataset",
            id="empty-eval",
        ),
        pytest.param(
            "stream",
            None,
            "train_dataset is an IterableDataset; SFTTrainer tokenises and packs",
            id="iterable",
        ),
    ],
)
def test_missing_empty_or_streaming_dataset_is_refused_before_the_model_loads(tmp_path, train, eval_, needle):
    if train == "stream":
        train = IterableDataset.from_generator(_stream)
    with pytest.raises(ValueError) as err:
        SFTTrainer(model=NO_MODEL, args=config(tmp_path), train_dataset=train, eval_dataset=eval_)
    assert needle in str(err.value)


def test_a_prompt_without_completion_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="has a 'prompt' column but no 'completion' column.*add the missing"):
        SFTTrainer(model=NO_MODEL, args=config(tmp_path), train_dataset=Dataset.from_dict({"prompt": ["a"]}))


# ---- rows, through the trainer (after the model loads, before any step) ---------------------------------


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        pytest.param(
            [{"content": "hi"}, {"content": "hello"}],
            "Row 1: message 0 of column 'messages' has role None; expected one of",
            id="no-roles",
        ),
        pytest.param(
            [USER, USER],
            "Row 1: message 1 of column 'messages' is a 'user' message after a 'user' message; a user message",
            id="user-after-user",
        ),
        pytest.param(
            [ASSISTANT, USER],
            "Row 1: message 0 of column 'messages' is a 'assistant' message at the start",
            id="assistant-first",
        ),
        pytest.param([], "Row 1: column 'messages' is an empty conversation. Drop the row", id="empty"),
    ],
)
def test_bad_conversations_name_the_row_the_column_and_the_fix(tmp_path, tok, messages, needle):
    with pytest.raises(ValueError) as err:
        trainer(tmp_path, tok, chats([USER, ASSISTANT], messages))
    assert needle in str(err.value)
    assert (
        "Fix the order" in str(err.value) or "dataset.filter" in str(err.value) or "'role'" in str(err.value)
    )


def test_empty_completion_names_the_row_and_the_fix(tmp_path, tok):
    data = Dataset.from_dict({"prompt": ["a", "b", "c"], "completion": [" x", " y", ""]})
    with pytest.raises(ValueError, match=r"Row 2: the completion is empty.*dataset\.filter"):
        trainer(tmp_path, tok, data)


def test_formatting_func_that_returns_no_string_names_the_row(tmp_path, tok):
    data = Dataset.from_dict({"q": ["one", "two"], "a": ["1", "2"]})
    with pytest.raises(ValueError, match="Row 0: formatting_func returned list, not a string"):
        trainer(tmp_path, tok, data, formatting_func=lambda row: [row["q"], row["a"]])


def test_a_non_text_value_in_a_later_row_names_the_row(tmp_path, tok):
    data = Dataset.from_dict({"text": ["one two", None]})
    with pytest.raises(
        ValueError, match="Row 1: column 'text' holds NoneType, not text. Fix the row, or drop it."
    ):
        trainer(tmp_path, tok, data)


PROMPTS = Dataset.from_dict(
    {
        "prompt": ["one two three four five six seven eight"] * 3 + ["a"],
        "completion": [" nine"] * 3 + [" b"],
    }
)


def test_prompts_longer_than_max_length_are_dropped_with_a_count(tmp_path, tok):
    with pytest.warns(
        UserWarning, match=r"3 of 4 rows have no target token left after truncation to max_length=4"
    ) as rec:
        t = trainer(tmp_path, tok, PROMPTS, config={"max_length": 4})
    assert "they were dropped. To keep them: raise max_length" in str(rec[0].message)
    assert len(t.train_dataset) == 1


def test_every_prompt_longer_than_max_length_is_an_error(tmp_path, tok):
    with pytest.raises(
        ValueError, match=r"All 3 rows of the SFT dataset have no target token.*Fix: raise max_length"
    ):
        trainer(
            tmp_path, tok, PROMPTS.select(range(3)), config={"max_length": 4, "completion_only_loss": True}
        )


# ---- loss masks and chat templates ------------------------------------------------------------------


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, None], ids=["template-of-no-family", "no-template"])
def test_assistant_only_loss_without_markers_or_a_family_is_refused(tmp_path, template):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    with pytest.raises(ValueError) as err:
        trainer(tmp_path, tok, chats([USER, ASSISTANT]), config={"assistant_only_loss": True})
    text = str(err.value)
    assert "posttrain has no marked template for its family" in text
    assert "SFTConfig.chat_template_path" in text and "assistant_only_loss=False" in text


def test_assistant_only_loss_on_plain_text_is_refused(tmp_path, tok):
    with pytest.raises(
        ValueError, match="assistant_only_loss=True needs chat messages, but the dataset is language"
    ):
        trainer(tmp_path, tok, Dataset.from_dict({"text": ["a b"]}), config={"assistant_only_loss": True})


def test_chat_template_path_to_a_tokenizer_without_a_template_or_to_nothing(tmp_path, tok):
    source = build_tiny_tokenizer()
    source.chat_template = None
    source.save_pretrained(tmp_path / "source")
    args = config(tmp_path, chat_template_path=str(tmp_path / "source"))
    with pytest.raises(
        ValueError, match="The tokenizer at chat_template_path=.* has no chat template. Point it"
    ):
        trainer(tmp_path, tok, chats([USER, ASSISTANT]), args=args)
    args = config(tmp_path, chat_template_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is neither a '.jinja' file nor a tokenizer that could be loaded"):
        trainer(tmp_path, tok, chats([USER, ASSISTANT]), args=args)


def test_chat_template_path_that_adds_tokens_to_a_peft_model_is_refused(tmp_path, tok):
    from peft import LoraConfig

    source = build_tiny_tokenizer()
    source.add_tokens(["<|turn_end|>"], special_tokens=True)
    source.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|turn_end|>{% endfor %}"
    )
    source.save_pretrained(tmp_path / "source")
    args = config(tmp_path, chat_template_path=str(tmp_path / "source"))
    with pytest.raises(
        ValueError, match=r"writes tokens this tokenizer lacks \(\['<\|turn_end\|>'\]\).*PEFT adapter"
    ):
        trainer(
            tmp_path,
            tok,
            chats([USER, ASSISTANT]),
            args=args,
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )


def test_named_templates_without_a_default_are_refused(tok):
    tok.chat_template = {"short": CHAT_TEMPLATE, "long": CHAT_TEMPLATE}
    with pytest.raises(
        ValueError, match=r"several chat templates \(\['long', 'short'\]\) and none named 'default'"
    ):
        chat.render(tok, [USER])


# ---- the model's attention, the trainer API ----------------------------------------------------------


def test_padding_free_with_an_attention_that_mixes_sequences_is_refused(tmp_path, tok):
    model = build_tiny_model(tok)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError) as err:
        trainer(
            tmp_path, tok, Dataset.from_dict({"text": ["a b"]}), model=model, config={"padding_free": True}
        )
    assert "attention implementation 'flex_attention' would let them attend to each other" in str(err.value)
    assert "set packing=False and padding_free=False" in str(err.value)


@pytest.mark.parametrize("hook", ["compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics"])
def test_every_logit_hook_is_refused_by_name(tmp_path, hook):
    with pytest.raises(NotImplementedError, match=f"^{hook} need the model's full"):
        SFTTrainer(model=NO_MODEL, args=config(tmp_path), train_dataset=None, **{hook: lambda *a: None})


def test_compute_loss_does_not_return_outputs(tmp_path, tok):
    t = trainer(tmp_path, tok, Dataset.from_dict({"text": ["a b"]}))
    with pytest.raises(ValueError, match="SFTTrainer.compute_loss does not return model outputs"):
        t.compute_loss(t.model, None, return_outputs=True)


# ---- the data functions called directly ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        pytest.param(
            {"messages": "hello"}, "Row 3: column 'messages' holds str, not a list of messages", id="str"
        ),
        pytest.param(
            {"messages": ["hello"]},
            "Row 3: message 0 of column 'messages' is a str, not a dict",
            id="not-a-dict",
        ),
        pytest.param({"messages": None}, "Row 3: no 'messages' (or 'conversations') value", id="none"),
    ],
)
def test_message_values_of_the_wrong_type_name_the_row(tok, row, needle):
    with pytest.raises(ValueError) as err:
        tokenize_row(row, tok, "conversational", index=3)
    assert needle in str(err.value)


def test_prepare_dataset_refuses_a_stream(tok):
    with pytest.raises(
        ValueError, match="prepare_dataset needs a datasets.Dataset or a list of dicts, got generator"
    ):
        prepare_dataset(({"text": "a"} for _ in range(2)), tok)


def test_a_formatting_func_on_a_tokenised_dataset_is_ignored_with_a_warning(tok):
    rows = [{"input_ids": [5, 6, 7]}]
    with pytest.warns(UserWarning, match="already tokenised .* so formatting_func is ignored. Remove"):
        out = prepare_dataset(rows, tok, formatting_func=lambda row: "text")
    assert out == [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}]


def test_truncating_to_less_than_one_token_is_refused():
    with pytest.raises(ValueError, match=r"max_length=0 must be at least 1 \(or None for no truncation\)"):
        truncate([1, 2], [1, 1], 0)


def test_packing_and_collation_input_errors():
    with pytest.raises(ValueError, match="collate_padded got no rows; pass at least one."):
        packing.collate_padded([], 0)
    with pytest.raises(ValueError, match="collate_packed got no rows; pass at least one."):
        packing.collate_packed([])
    with pytest.raises(ValueError, match=r"Every item length must lie in \[1, 4\] to be packed; got \[5\]"):
        packing.best_fit_decreasing([5], 4)


def test_metric_inputs_of_different_shapes():
    with pytest.raises(ValueError, match=r"values \(2, 3\) and mask \(2, 2\) must have the same shape"):
        losses.mean_token_accuracy(torch.ones(2, 3), torch.ones(2, 2))


# ---- BEMA and selective activation checkpointing ------------------------------------------------------


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))


def test_bema_model_errors(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    cb = BEMACallback(update_freq=1)
    with pytest.raises(
        ValueError, match="BEMACallback needs the model; use it as a transformers Trainer callback"
    ):
        cb.on_train_begin(args, state, None, model=None)
    frozen = _Toy().requires_grad_(False)
    with pytest.raises(ValueError, match="BEMACallback found no trainable parameter in the model"):
        cb.on_train_begin(args, state, None, model=frozen)
    cb.on_train_begin(args, state, None, model=_Toy())
    saved = cb.state_dict()
    with pytest.raises(ValueError, match=r"BEMA tracks parameters the model does not have: \['w'\]"):
        state.global_step = 1
        cb.on_step_end(args, state, None, model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"BEMA state tracks parameters the model no longer trains: \['w'\]"):
        BEMACallback().load_state_dict(saved, model=torch.nn.Linear(2, 2))


def test_layers_checkpointed_with_reentrant_or_their_own_context_refuse_sac():
    reentrant = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    with pytest.raises(ValueError, match="the model's layers were set up with use_reentrant=True"):
        sac.selective_checkpoint_func(reentrant)
    own = functools.partial(torch.utils.checkpoint.checkpoint, context_fn=lambda: None)
    with pytest.raises(ValueError, match="has both 'selective' and 'context_fn'"):
        sac.selective_checkpoint_func(own)


def test_selective_checkpointing_config_errors_also_hold_for_grpo(tmp_path):
    """The check lives in the shared config base, so GRPOConfig raises the same messages as SFTConfig."""
    from posttrain import GRPOConfig

    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "num_generations": 4, "max_completion_length": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            ValueError, match=r"gradient_checkpointing_kwargs\['selective'\]='yes' is invalid"
        ):
            GRPOConfig(
                **{
                    **values,
                    "gradient_checkpointing": True,
                    "gradient_checkpointing_kwargs": {"selective": "yes"},
                }
            )
        with pytest.raises(ValueError, match="needs gradient_checkpointing=True"):
            GRPOConfig(
                **{
                    **values,
                    "gradient_checkpointing": False,
                    "gradient_checkpointing_kwargs": {"selective": True},
                }
            )
