"""Reward models: sequence-classification models used as reward functions.

``GRPOTrainer(reward_funcs=...)`` accepts, next to callables, a hub id or local path (loaded with
``AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, **model_init_kwargs)``)
or a ``PreTrainedModel`` sequence classifier. :func:`resolve_reward_funcs` turns each such entry
into a :class:`RewardModel`, a callable with the reward-function signature that renders each
prompt and completion with the reward model's own tokenizer, scores the texts in batches and
returns ``logits[:, 0]`` per text.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from posttrain.data import chat, formats
from posttrain.models import loading

#: ``tokenizer.model_max_length`` above this is transformers' "no limit" placeholder.
_NO_LIMIT = 10**9

#: Keyword arguments of ``from_pretrained`` that also locate the config (checked before loading).
_LOCATING_KWARGS = ("revision", "subfolder", "cache_dir", "token", "local_files_only", "force_download")


def _is_sequence_classifier(model: Any) -> bool:
    """Whether ``model``'s class (or a base class) is a ``...ForSequenceClassification``."""
    return any(cls.__name__.endswith("ForSequenceClassification") for cls in type(model).__mro__)


def _model_name(model: Any) -> str:
    """The last path component of ``config._name_or_path``, else the class name."""
    source = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    name = os.path.basename(source.rstrip("/\\"))
    return name or type(model).__name__


def _default_max_length(model: Any, tokenizer: Any) -> int | None:
    """The longest input the model accepts: the smaller of the tokenizer's and the config's limits."""
    limits = []
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < _NO_LIMIT:
        limits.append(tok_limit)
    config = model.config.get_text_config()
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append(positions)
    return min(limits) if limits else None


def _as_messages(completion: Any) -> list[dict[str, Any]]:
    """A completion as a list of messages (a bare string becomes one assistant message)."""
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    return list(completion)


def _conversation(prompt: list[dict[str, Any]], completion: Any) -> list[dict[str, Any]]:
    """``prompt + completion``, without repeating an assistant prefix the completion already holds.

    When a prompt ends with a (partial) assistant message, generation continues it and the
    trainer hands over the completion with that prefix included (``formats.as_completion``); the
    prefix message is then dropped from the prompt so it is not rendered twice.
    """
    messages = _as_messages(completion)
    last = prompt[-1] if prompt else None
    if (
        last is not None
        and last.get("role") == "assistant"
        and messages
        and messages[0].get("role") == "assistant"
        and isinstance(last.get("content"), str)
        and isinstance(messages[0].get("content"), str)
        and messages[0]["content"].startswith(last["content"])
    ):
        return list(prompt[:-1]) + messages
    return list(prompt) + messages


class RewardModel:
    """A sequence-classification model and its tokenizer, called like a reward function.

    ``reward_model(prompts=..., completions=..., **ignored) -> list[float]`` renders each pair
    (conversational: ``tokenizer.apply_chat_template(prompt + completion, tokenize=False)``;
    standard: ``prompt + completion``), tokenizes it with the reward model's tokenizer (no
    special tokens added: a chat template writes its own), right-pads, and returns
    ``logits[:, 0]`` of the model as floats, in eval mode and without gradients, ``batch_size``
    texts at a time on the model's device. Texts longer than ``max_length`` tokens keep their
    last ``max_length`` tokens (``truncation_side="left"``, the end is where the model reads the
    score) or their first (``"right"``), with a warning the first time.

    Neither the tokenizer nor the model's weights are changed. If the model's config has no
    ``pad_token_id``, it is set to the padding id used here (the tokenizer's pad token, else its
    EOS token), which the model needs to find the last token of each padded row.

    Args:
        model: a ``...ForSequenceClassification`` model with ``num_labels == 1``.
        tokenizer: its tokenizer (or a processor wrapping one).
        batch_size: texts per forward pass.
        max_length: longest input in tokens; default: the smaller of
            ``tokenizer.model_max_length`` and the config's ``max_position_embeddings``.
        truncation_side: ``"left"`` (default) or ``"right"``.
        chat_template_kwargs: extra keyword arguments for ``apply_chat_template``.
        name: the name its metrics are logged under; default: the last path component of
            ``model.config._name_or_path``, else the model's class name.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        batch_size: int = 16,
        max_length: int | None = None,
        truncation_side: str = "left",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1; got {batch_size!r}.")
        if truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right'; got {truncation_side!r}.")
        _check_model(model)
        if tokenizer is None:
            raise ValueError("RewardModel needs the reward model's tokenizer; got None.")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.truncation_side = truncation_side
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = name or _model_name(model)
        text_tok = getattr(tokenizer, "tokenizer", tokenizer)
        self._text_tokenizer = text_tok
        self.pad_token_id = _padding_id(model, text_tok, self.__name__)
        config = model.config.get_text_config()
        if config.pad_token_id is None:
            config.pad_token_id = self.pad_token_id
        self.max_length = max_length if max_length is not None else _default_max_length(model, text_tok)
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1; got {self.max_length}.")
        self._warned_truncation = False
        self.model.eval()

    def __repr__(self) -> str:
        return f"RewardModel({self.__name__!r}, batch_size={self.batch_size}, max_length={self.max_length})"

    @property
    def device(self) -> torch.device:
        """The device the inputs are sent to (the model's)."""
        return self.model.device

    def to(self, device: torch.device | str) -> RewardModel:
        """Move the model to ``device`` (not for models dispatched with a ``device_map``)."""
        if getattr(self.model, "hf_device_map", None) is None:
            self.model.to(device)
        return self

    # ---- rendering -----------------------------------------------------------------------------

    def render(self, prompt: Any, completion: Any) -> str:
        """The text the reward model scores for one prompt and completion."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion
        if not formats.is_conversational(prompt):
            raise TypeError(
                f"Reward model '{self.__name__}' got a prompt of type {type(prompt).__name__} with a "
                f"completion of type {type(completion).__name__}; pass both as strings (standard format) "
                "or the prompt as a list of {'role', 'content'} messages (conversational format)."
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"The inputs are conversational but the tokenizer of reward model '{self.__name__}' has no "
                "chat template to render them with. Pass a reward processing class with a chat template "
                "(reward_processing_classes=[...]), set tokenizer.chat_template, or use plain-text prompts."
            )
        messages = _conversation(list(prompt), completion)
        return chat.render(self.tokenizer, messages, variables=self.chat_template_kwargs)

    # ---- scoring -------------------------------------------------------------------------------

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, truncated to ``max_length`` (warning once)."""
        ids = [list(x) for x in self._text_tokenizer(texts, add_special_tokens=False)["input_ids"]]
        limit = self.max_length
        if limit is None:
            return ids
        too_long = sum(len(x) > limit for x in ids)
        if too_long and not self._warned_truncation:
            self._warned_truncation = True
            kept = "last" if self.truncation_side == "left" else "first"
            warnings.warn(
                f"Reward model '{self.__name__}': {too_long} of {len(ids)} texts are longer than its "
                f"max_length={limit} tokens and keep only their {kept} {limit} tokens. (Warned once.)",
                stacklevel=3,
            )
        if self.truncation_side == "left":
            return [x[-limit:] if len(x) > limit else x for x in ids]
        return [x[:limit] for x in ids]

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad to the longest row: ``(input_ids, attention_mask)`` on the model's device."""
        width = max(max(len(r) for r in rows), 1)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Score already rendered texts: ``logits[:, 0]`` of each, as floats."""
        texts = list(texts)
        if not texts:
            return []
        ids = self._encode(texts)
        if any(len(x) == 0 for x in ids):
            empty = next(i for i, x in enumerate(ids) if len(x) == 0)
            raise ValueError(
                f"Reward model '{self.__name__}' got an empty text at position {empty}; it has no token "
                "to read a score from."
            )
        self.model.eval()
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(ids), self.batch_size):
                input_ids, mask = self._pad(ids[start : start + self.batch_size])
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits
                scores.extend(logits[:, 0].float().cpu().tolist())
        return scores

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """One score per completion; ``prompts[i]`` is the prompt of ``completions[i]``."""
        if prompts is None or len(prompts) != len(completions):
            got = "None" if prompts is None else str(len(prompts))
            raise ValueError(
                f"Reward model '{self.__name__}' needs one prompt per completion; got {got} prompts for "
                f"{len(completions)} completions."
            )
        texts = [self.render(p, c) for p, c in zip(prompts, completions, strict=True)]
        return self.score_texts(texts)


def _check_model(model: Any) -> None:
    """A reward model must be a sequence classifier with one label."""
    if not isinstance(model, PreTrainedModel) or not _is_sequence_classifier(model):
        raise TypeError(
            f"A reward model must be a sequence classification model (e.g. loaded with "
            f"AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)); got "
            f"{type(model).__name__}. Pass its name as a string to load it that way, or wrap your model "
            "in a reward function."
        )
    num_labels = getattr(model.config, "num_labels", None)
    if num_labels != 1:
        raise ValueError(
            f"Reward model {_model_name(model)!r} has num_labels={num_labels}, but a reward model must "
            "output one number per text. Load a reward model trained with num_labels=1, or wrap this "
            "classifier in a reward function that turns its logits into one score (e.g. the probability "
            "of the positive class)."
        )


def _padding_id(model: Any, tokenizer: Any, name: str) -> int:
    """The id padded with: the model config's pad id, else the tokenizer's pad, else its EOS."""
    config_pad = model.config.get_text_config().pad_token_id
    if config_pad is not None:
        return int(config_pad)
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"Neither reward model '{name}' (config.pad_token_id) nor its tokenizer (pad or EOS token) defines a "
        "padding token. Set tokenizer.pad_token on the reward processing class."
    )


def _check_checkpoint(source: str, kwargs: Mapping[str, Any]) -> None:
    """Before loading: refuse a classifier with several labels, warn about a missing score head."""
    from transformers import AutoConfig

    config_kwargs = {k: kwargs[k] for k in _LOCATING_KWARGS if k in kwargs}
    config = AutoConfig.from_pretrained(
        source, trust_remote_code=kwargs.get("trust_remote_code", False), **config_kwargs
    )
    architectures = list(getattr(config, "architectures", None) or [])
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        if config.num_labels != 1:
            raise ValueError(
                f"The reward model '{source}' is a classifier with num_labels={config.num_labels}, but a "
                "reward model must output one number per text. Use a reward model trained with "
                "num_labels=1, or load this classifier yourself and wrap it in a reward function that turns "
                "its logits into one score."
            )
    elif architectures:
        warnings.warn(
            f"The reward model '{source}' is a {architectures[0]} checkpoint, not a sequence classifier: its "
            "score head is newly initialized, so its rewards are random until it is trained.",
            stacklevel=3,
        )


def load_reward_model(
    name_or_model: str | PreTrainedModel,
    tokenizer: Any = None,
    init_kwargs: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    **reward_model_kwargs: Any,
) -> RewardModel:
    """Build a :class:`RewardModel` from a name or a loaded model.

    Args:
        name_or_model: a hub id, a local folder saved with ``save_pretrained``, an embedded name,
            or a ``PreTrainedModel`` sequence classifier with ``num_labels == 1``.
        tokenizer: the reward model's tokenizer; ``None`` loads it with
            ``AutoTokenizer.from_pretrained`` from the name (or ``config._name_or_path``).
        init_kwargs: ``from_pretrained`` keyword arguments for a name (``model_init_kwargs``);
            float32 unless a ``dtype`` is given; ``revision`` also selects the tokenizer. Ignored
            for a loaded model.
        trust_remote_code: allow custom code for the model and its tokenizer.
        **reward_model_kwargs: passed to :class:`RewardModel` (``batch_size``, ``max_length``, ...).

    Raises:
        FileNotFoundError: a local path that does not exist.
        TypeError: a model that is not a sequence classifier.
        ValueError: a classifier with more than one label, or no padding token anywhere.
    """
    from transformers import AutoModelForSequenceClassification

    kwargs = dict(init_kwargs or {})
    revision = kwargs.get("revision")
    if isinstance(name_or_model, str):
        source = _existing_source(name_or_model)
        _set_pretrained_kwargs(kwargs, trust_remote_code)
        _check_checkpoint(source, kwargs)  # called here: its warning's stacklevel points at our caller
        model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, **kwargs)
        reward_model_kwargs.setdefault("name", _model_name_from_string(name_or_model))
    elif isinstance(name_or_model, PreTrainedModel):
        model = name_or_model
        _check_model(model)
        source = str(getattr(model.config, "_name_or_path", "") or "")
    else:
        raise TypeError(
            f"A reward model is given as a hub id, a local path or a PreTrainedModel; got "
            f"{type(name_or_model).__name__}."
        )
    if tokenizer is None:
        tokenizer = _own_tokenizer(model, source, revision, trust_remote_code)
    return RewardModel(model, tokenizer, **reward_model_kwargs)


def _existing_source(name: str) -> str:
    """The local folder or hub id ``name`` resolves to (``loading.resolve_model_path``)."""
    try:
        return loading.resolve_model_path(name)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"The reward model path '{name}' does not exist. Pass an existing folder saved with "
            "save_pretrained, or the hub id of a sequence classification reward model."
        ) from err


def _set_pretrained_kwargs(kwargs: dict[str, Any], trust_remote_code: bool) -> None:
    """None, once ``kwargs`` lost ``num_labels`` (1 at most) and has ``dtype`` and ``trust_remote_code``."""
    requested = kwargs.pop("num_labels", 1)
    if requested != 1:
        raise ValueError(
            f"model_init_kwargs sets num_labels={requested}, but reward models are loaded with "
            "num_labels=1 (one score per text). Remove num_labels from model_init_kwargs."
        )
    kwargs["dtype"] = loading._dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    kwargs.setdefault("trust_remote_code", trust_remote_code)


def _own_tokenizer(model: Any, source: str, revision: Any, trust_remote_code: bool) -> Any:
    """The reward model's tokenizer, loaded from ``source`` (its name or path)."""
    if not source:
        raise ValueError(
            f"Reward model {_model_name(model)!r} has no name or path to load its tokenizer from "
            "(config._name_or_path is empty). Pass its tokenizer in reward_processing_classes."
        )
    return loading.load_tokenizer(source, revision, trust_remote_code)


def _model_name_from_string(name: str) -> str:
    """The last path component of a hub id or path, as given by the user."""
    return os.path.basename(name.rstrip("/\\")) or name


def resolve_reward_funcs(
    reward_funcs: Any,
    reward_processing_classes: Any = None,
    init_kwargs: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[Callable[..., list[float | None]]]:
    """Turn ``reward_funcs`` into a list of callables, loading the reward models among them.

    Callables (including :class:`RewardModel` instances) are kept as they are; strings and
    ``PreTrainedModel`` s become :class:`RewardModel` s, each with its entry of
    ``reward_processing_classes`` (``None``: the model's own tokenizer is loaded).

    Args:
        reward_funcs: one reward function, model or name, or a list of them.
        reward_processing_classes: ``None``; one tokenizer, when there is exactly one reward
            function; or a list with one entry (a tokenizer or ``None``) per reward function, in
            the same order (entries of callables are ignored).
        init_kwargs: ``model_init_kwargs`` for reward models given by name.
        trust_remote_code: allow custom code for reward models and their tokenizers.
        chat_template_kwargs: extra ``apply_chat_template`` arguments when rendering
            conversations for the reward models.

    Raises:
        ValueError: ``reward_processing_classes`` not aligned with ``reward_funcs``.
        TypeError: an entry that is neither callable, a string nor a ``PreTrainedModel``.
    """
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    classes = _aligned_processing_classes(reward_processing_classes, len(funcs))
    resolved: list[Callable[..., list[float | None]]] = []
    for i, (func, tokenizer) in enumerate(zip(funcs, classes, strict=True)):
        if isinstance(func, (str, PreTrainedModel)):
            resolved.append(
                load_reward_model(
                    func,
                    tokenizer=tokenizer,
                    init_kwargs=init_kwargs,
                    trust_remote_code=trust_remote_code,
                    chat_template_kwargs=chat_template_kwargs,
                )
            )
        elif callable(func):
            resolved.append(func)
        else:
            raise TypeError(
                f"reward_funcs[{i}] is a {type(func).__name__}; each reward function must be a callable, a "
                "hub id or path of a reward model, or a PreTrainedModel sequence classifier."
            )
    return resolved


def _aligned_processing_classes(reward_processing_classes: Any, num_funcs: int) -> list[Any]:
    """One processing class (or ``None``) per reward function, in order."""
    if reward_processing_classes is None:
        return [None] * num_funcs
    if isinstance(reward_processing_classes, (list, tuple)):
        classes = list(reward_processing_classes)
        if len(classes) != num_funcs:
            raise ValueError(
                f"reward_processing_classes has {len(classes)} entries but there are {num_funcs} reward "
                "functions; give one entry per reward function, in the same order (None for callables, "
                "or to load a reward model's own tokenizer)."
            )
        return classes
    if num_funcs != 1:
        raise ValueError(
            f"A single reward processing class was given for {num_funcs} reward functions; a single "
            "one only goes with a single reward function. Pass a list with one entry per reward "
            "function, in the same order (None for callables, or to load a reward model's own tokenizer)."
        )
    return [reward_processing_classes]


def reward_models(funcs: Sequence[Any]) -> list[RewardModel]:
    """The :class:`RewardModel` s among resolved reward functions (to move them to a device)."""
    return [f for f in funcs if isinstance(f, RewardModel)]
