"""Loading the policy and its tokenizer from a hub id, a local path or an embedded name.

The policy is of the kind its trainer family trains (``BaseTrainer._model_kind``): a causal LM
(``"causal_lm"``), or a sequence classifier with one output (``"sequence_classification"``: a
reward model; a causal LM checkpoint gets a new, untrained score head).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch


def resolve_model_path(name: str) -> str:
    """Map an embedded model name to its cached folder; check that a local path exists.

    A string that looks like a path (starts with ``.``, ``/`` or ``~``, or has more than one
    ``/``) must exist. Anything else is left to the hub.
    """
    from posttrain.models.embedded import is_embedded_name, resolve_embedded

    if is_embedded_name(name):
        return resolve_embedded(name)
    expanded = os.path.expanduser(name)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local and not os.path.isdir(expanded):
        raise FileNotFoundError(
            f"The model path '{name}' does not exist. Pass an existing folder saved with save_pretrained, "
            "a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or the embedded name 'smollm2-135m-instruct'."
        )
    return expanded if os.path.isdir(expanded) else name


def _dtype(value: Any) -> Any:
    if value is None:
        return torch.float32
    if isinstance(value, str) and value != "auto":
        return getattr(torch, value)
    return value


#: The kinds of model a trainer family trains (``BaseTrainer._model_kind``).
MODEL_KINDS = ("causal_lm", "sequence_classification")


def load_policy(
    name: str,
    init_kwargs: Mapping[str, Any] | None,
    trust_remote_code: bool,
    quantization_config: Any = None,
    device: torch.device | None = None,
    kind: str = "causal_lm",
) -> Any:
    """Load the policy by name with ``model_init_kwargs``; float32 unless a dtype is given.

    ``kind="sequence_classification"`` loads ``AutoModelForSequenceClassification`` with
    ``num_labels=1``; from a checkpoint that is not a sequence classifier (a causal LM) the
    score head is new and randomly initialised, with a warning.

    Args:
        name: hub id, local path or embedded name.
        init_kwargs: ``model_init_kwargs`` (``dtype``, ``revision``, ``attn_implementation``, ...).
        trust_remote_code: allow the model's own code from the hub.
        quantization_config: e.g. ``BitsAndBytesConfig(load_in_4bit=True)`` to load the weights
            quantized (QLoRA); ``init_kwargs["quantization_config"]`` is used when this is ``None``.
        device: the process's device. A quantized model is loaded straight onto it when it is
            an accelerator (each process onto its own), unless ``device_map`` is given.
        kind: one of ``MODEL_KINDS``.

    Raises:
        ValueError: ``init_kwargs`` asks a sequence classifier for ``num_labels`` other than 1.
    """
    from transformers import AutoModelForCausalLM

    kwargs = dict(init_kwargs or {})
    kwargs["dtype"] = _dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if kwargs.get("quantization_config") is not None and device is not None and device.type != "cpu":
        kwargs.setdefault("device_map", {"": device})
    if kind == "sequence_classification":
        return _load_sequence_classifier(resolve_model_path(name), kwargs)
    path = resolve_model_path(name)
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as error:
        # a vision-language model (Qwen2-VL, SmolVLM, LLaVA-NeXT) has no causal LM class
        if "Unrecognized configuration class" not in str(error):
            raise
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(path, **kwargs)


def is_vision_model(model: Any) -> bool:
    """Whether ``model`` (or a ``PeftModel``'s base) reads images: its config has a vision part."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return getattr(config, "vision_config", None) is not None


def check_reads_images(model: Any, processing_class: Any, has_images: bool) -> None:
    """Datasets with images need a vision-language model and its processor (image processor, placeholders).

    Raises:
        ValueError: ``has_images`` with a text-only model, or with a tokenizer that has no image processor.
    """
    if not has_images:
        return
    if not is_vision_model(model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        raise ValueError(
            f"the dataset has images, but the model is a {type(base).__name__}, a text-only model that cannot read "
            "them. Train a vision-language model (e.g. Qwen2VLForConditionalGeneration) with its processor, or "
            "remove the image column (dataset.remove_columns('image'))."
        )
    if getattr(processing_class, "image_processor", None) is None:
        raise ValueError(
            "the dataset has images, but processing_class is a tokenizer without an image processor; pass the "
            "vision-language model's processor (transformers.AutoProcessor.from_pretrained(name)), or leave "
            "processing_class None to load it with the model."
        )


#: The config fields of a vision-language model that name its image (and video) placeholder tokens.
PLACEHOLDER_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def image_placeholder_ids(model: Any) -> list[int]:
    """A vision-language model's image and video placeholder token ids (none for a text model)."""
    if not is_vision_model(model):
        return []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    values = (getattr(base.config, name, None) for name in PLACEHOLDER_FIELDS)
    return sorted({v for v in values if isinstance(v, int)})


def is_sequence_classifier(model: Any) -> bool:
    """Whether ``model``'s class (or a base class) is a ``...ForSequenceClassification``."""
    return any(cls.__name__.endswith("ForSequenceClassification") for cls in type(model).__mro__)


def _load_sequence_classifier(path: str, kwargs: dict[str, Any]) -> Any:
    """``AutoModelForSequenceClassification`` with one label; warns when the score head is new."""
    from transformers import AutoModelForSequenceClassification

    requested = kwargs.pop("num_labels", 1)
    if requested != 1:
        raise ValueError(
            f"model_init_kwargs sets num_labels={requested!r}, but the model is loaded as a sequence classifier "
            "with num_labels=1 (one score per text). Remove num_labels from model_init_kwargs."
        )
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **kwargs)
    architectures = list(getattr(model.config, "architectures", None) or [])  # the checkpoint's
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        warnings.warn(
            f"'{path}' is a {architectures[0]} checkpoint, not a sequence classifier: it was loaded as "
            f"{type(model).__name__} with a new, randomly initialised score head, which training learns.",
            UserWarning,
            stacklevel=6,  # the line that built the trainer
        )
    return model


def check_model_kind(model: Any, kind: str) -> None:
    """Refuse a model (or a ``PeftModel``'s base) that is not of the trainer family's kind.

    Raises:
        TypeError: ``"causal_lm"`` and the model cannot generate.
        ValueError: ``"sequence_classification"`` and the model is not a sequence classifier
            with one label.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"Unknown model kind {kind!r}; a trainer's _model_kind is one of {MODEL_KINDS}.")
    if kind == "causal_lm":
        if not hasattr(model, "generate"):
            raise TypeError("model must be a causal language model (it has no generate method).")
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_sequence_classifier(base):
        raise ValueError(
            f"model is a {type(base).__name__}, which has no score head; this trainer trains a sequence classifier "
            "(one score per text). Pass the model's hub id or folder instead (a causal LM checkpoint is loaded "
            "with a new score head), or load it yourself with AutoModelForSequenceClassification.from_pretrained("
            "name, num_labels=1); for a model built in memory, save it with save_pretrained and pass the folder."
        )
    num_labels = getattr(base.config, "num_labels", None)
    if num_labels != 1:
        raise ValueError(
            f"model is a {type(base).__name__} with num_labels={num_labels}, but a reward model outputs one score "
            "per text. Load it with num_labels=1 (AutoModelForSequenceClassification.from_pretrained(name, "
            "num_labels=1)), or pass its name and the trainer does."
        )


def load_tokenizer(
    source: str, revision: str | None, trust_remote_code: bool, processor: bool = False
) -> Any:
    """Load the tokenizer for a model name or path (embedded names resolved).

    ``processor``: load the model's processor instead (``AutoProcessor``: a vision-language
    model's image processor and tokenizer together).
    """
    from transformers import AutoProcessor, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    auto = AutoProcessor if processor else AutoTokenizer
    return auto.from_pretrained(resolve_model_path(source), **kwargs)


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding for generation; the pad token falls back to EOS."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                "The tokenizer has neither a pad token nor an EOS token. Set tokenizer.pad_token before "
                "passing it as processing_class."
            )
        tok.pad_token = tok.eos_token
    return tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


#: Suffixes of a Jinja chat template file (``chat_template_path``).
TEMPLATE_SUFFIXES = (".jinja", ".j2")


def apply_chat_template_path(path: str, tokenizer: Any, model: Any) -> list[str]:
    """Give ``tokenizer`` the chat template found at ``path``.

    ``path`` is a Jinja file (``.jinja`` / ``.j2``), or a tokenizer (local folder or hub id)
    whose template is taken. From a tokenizer, its special tokens that the template writes and
    this tokenizer lacks are added (the model's embeddings grow to match) and its EOS token
    becomes this tokenizer's EOS (the turn end the template writes), as a model trained on that
    template must learn to stop with it.

    Args:
        path: the template file, or the tokenizer to take it from.
        tokenizer: the tokenizer to change.
        model: the policy (resized when tokens are added).

    Returns:
        The tokens added.

    Raises:
        ValueError: an unreadable path, a source without a template, or new tokens for a PEFT
            model (whose embeddings the adapter cannot grow).
    """
    if os.path.isfile(path):
        if not path.endswith(TEMPLATE_SUFFIXES):
            raise ValueError(
                f"chat_template_path={path!r} is a file but not a Jinja template; give a '.jinja' (or '.j2') file, "
                "or a tokenizer folder or hub id whose chat template to use."
            )
        with open(path, encoding="utf-8") as handle:
            tokenizer.chat_template = handle.read()
        return []
    source = _load_source(path)
    template = getattr(source, "chat_template", None)
    if not template:
        raise ValueError(
            f"The tokenizer at chat_template_path={path!r} has no chat template. Point it at a tokenizer with one, "
            "or at a '.jinja' file."
        )
    texts = template.values() if isinstance(template, dict) else [template]
    needed = [
        t for t in source.get_added_vocab() if any(t in text for text in texts) or t == source.eos_token
    ]
    missing = [t for t in needed if t not in tokenizer.get_vocab()]
    from posttrain.models.peft import is_peft_model

    if missing and is_peft_model(model):
        raise ValueError(
            f"The chat template of {path!r} writes tokens this tokenizer lacks ({missing}); adding them grows the "
            "embeddings, which a PEFT adapter cannot train. Add the tokens and resize the base model before "
            "wrapping it (model.resize_token_embeddings), or use a template written with the existing tokens."
        )
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
        model.resize_token_embeddings(len(tokenizer))
    tokenizer.chat_template = template
    if source.eos_token and source.eos_token != tokenizer.eos_token:
        tokenizer.eos_token = source.eos_token
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
    return missing


def _load_source(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"chat_template_path={path!r} is neither a '.jinja' file nor a tokenizer that could be loaded ({exc}). "
            "Give a template file, a local tokenizer folder, or a hub id."
        ) from exc
