"""Tests of GRPOConfig: the spec contract (names, defaults, types), validation and derived values.

Only configs are constructed here (no model, no data), so the whole file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from transformers import HfArgumentParser, TrainingArguments

import posttrain
from posttrain.core import config as core_config
from posttrain.grpo.config import CHOICES, JSON_DICT_FIELDS, POSTTRAIN_EXTENSIONS, UNBUILT_OPTIONS, GRPOConfig
from posttrain.grpo.objectives import LOSS_TYPES as OBJECTIVES

# Transcribed from the `trl.GRPOConfig` signature in spec/grpo-trainer.pt.txt: every parameter
# and its default, in the spec's order.
SPEC_DEFAULTS: dict[str, Any] = {
    "output_dir": None,
    "per_device_train_batch_size": 8,
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "learning_rate": 1e-06,
    "lr_scheduler_type": "linear",
    "lr_scheduler_kwargs": None,
    "warmup_steps": 0,
    "optim": "adamw_torch_fused",
    "optim_args": None,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-08,
    "optim_target_modules": None,
    "gradient_accumulation_steps": 1,
    "average_tokens_across_devices": True,
    "max_grad_norm": 1.0,
    "label_smoothing_factor": 0.0,
    "bf16": None,
    "fp16": False,
    "bf16_full_eval": False,
    "fp16_full_eval": False,
    "tf32": None,
    "activation_checkpointing": None,
    "activation_checkpointing_kwargs": None,
    "gradient_checkpointing": True,
    "gradient_checkpointing_kwargs": None,
    "torch_compile": False,
    "torch_compile_backend": None,
    "torch_compile_mode": None,
    "use_liger_kernel": False,
    "liger_kernel_config": None,
    "use_cache": False,
    "neftune_noise_alpha": None,
    "torch_empty_cache_steps": None,
    "auto_find_batch_size": False,
    "logging_strategy": "steps",
    "logging_steps": 10,
    "logging_first_step": False,
    "log_on_each_node": True,
    "logging_nan_inf_filter": True,
    "include_num_input_tokens_seen": "no",
    "log_level": "passive",
    "log_level_replica": "warning",
    "disable_tqdm": None,
    "report_to": "none",
    "run_name": None,
    "project": "huggingface",
    "trackio_space_id": None,
    "trackio_bucket_id": None,
    "trackio_static_space_id": None,
    "eval_strategy": "no",
    "eval_steps": None,
    "eval_delay": 0,
    "per_device_eval_batch_size": 8,
    "prediction_loss_only": False,
    "eval_on_start": False,
    "eval_do_concat_batches": True,
    "eval_use_gather_object": False,
    "eval_accumulation_steps": None,
    "include_for_metrics": [],  # spec: <factory>, checked through the default_factory
    "batch_eval_metrics": False,
    "save_only_model": False,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_on_each_node": False,
    "save_total_limit": None,
    "enable_jit_checkpoint": False,
    "push_to_hub": False,
    "hub_token": None,
    "hub_private_repo": None,
    "hub_model_id": None,
    "hub_strategy": "every_save",
    "hub_always_push": False,
    "hub_revision": None,
    "load_best_model_at_end": False,
    "metric_for_best_model": None,
    "greater_is_better": None,
    "ignore_data_skip": False,
    "restore_callback_states_from_checkpoint": False,
    "full_determinism": False,
    "seed": 42,
    "data_seed": None,
    "use_cpu": False,
    "accelerator_config": None,
    "parallelism_config": None,
    "dataloader_drop_last": False,
    "dataloader_num_workers": 0,
    "dataloader_pin_memory": True,
    "dataloader_persistent_workers": False,
    "dataloader_prefetch_factor": None,
    "dataloader_multiprocessing_context": None,
    "dataloader_in_order": True,
    "remove_unused_columns": False,
    "label_names": None,
    "train_sampling_strategy": "random",
    "length_column_name": "length",
    "ddp_find_unused_parameters": None,
    "ddp_bucket_cap_mb": None,
    "ddp_broadcast_buffers": None,
    "ddp_static_graph": None,
    "ddp_backend": None,
    "ddp_timeout": 1800,
    "fsdp": None,
    "fsdp_config": None,
    "deepspeed": None,
    "debug": "",
    "skip_memory_metrics": True,
    "do_train": False,
    "do_eval": False,
    "do_predict": False,
    "resume_from_checkpoint": None,
    "local_rank": -1,
    "model_init_kwargs": None,
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "disable_dropout": False,
    "cast_lm_head_to_fp32": False,
    "num_generations": 8,
    "num_generations_eval": None,
    "max_completion_length": 512,
    "ds3_gather_for_generation": True,
    "shuffle_dataset": True,
    "pad_to_multiple_of": "auto",
    "generation_batch_size": None,
    "steps_per_generation": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "generation_kwargs": None,
    "chat_template_kwargs": None,
    "repetition_penalty": 1.0,
    "cache_implementation": None,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None,
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": 1,
    "beta": 0.0,
    "num_iterations": 1,
    "epsilon": 0.2,
    "delta": None,
    "epsilon_high": None,
    "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "importance_sampling_level": "token",
    "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize",
    "scale_rewards": "group",
    "loss_type": "dapo",
    "mask_truncated_completions": False,
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005,
    "entropy_target": 0.2,
    "max_tool_calling_iterations": None,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": True,
    "log_completions": False,
    "log_multimodal": True,
    "num_completions_to_print": None,
    "log_unique_prompts": False,
    "log_completions_hub_repo": None,
    "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None,
    "use_transformers_paged": False,
    "vllm_importance_sampling_cap": None,
}

# The annotations, as the spec writes them, of the fields GRPOConfig declares itself (the
# GRPO-specific ones and the TrainingArguments fields whose default GRPO changes).
SPEC_ANNOTATIONS: dict[str, str] = {
    "learning_rate": "float",
    "bf16": "bool | None",
    "gradient_checkpointing": "bool",
    "logging_steps": "float",
    "remove_unused_columns": "bool | None",
    "model_init_kwargs": "dict[str, typing.Any] | str | None",
    "trust_remote_code": "bool",
    "router_aux_loss_coef": "float | None",
    "disable_dropout": "bool",
    "cast_lm_head_to_fp32": "bool",
    "num_generations": "int | None",
    "num_generations_eval": "int | None",
    "max_completion_length": "int | None",
    "ds3_gather_for_generation": "bool",
    "shuffle_dataset": "bool | None",
    "pad_to_multiple_of": "int | str | None",
    "generation_batch_size": "int | None",
    "steps_per_generation": "int | None",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float | None",
    "generation_kwargs": "dict | str | None",
    "chat_template_kwargs": "dict | str | None",
    "repetition_penalty": "float",
    "cache_implementation": "str | None",
    "use_vllm": "bool",
    "vllm_mode": "str",
    "vllm_model_impl": "str",
    "vllm_enable_sleep_mode": "bool",
    "vllm_structured_outputs_regex": "str | None",
    "vllm_server_base_url": "str | None",
    "vllm_server_host": "str",
    "vllm_server_port": "int",
    "vllm_server_timeout": "float",
    "vllm_group_port": "int",
    "vllm_gpu_memory_utilization": "float",
    "vllm_max_model_length": "int | None",
    "vllm_tensor_parallel_size": "int",
    "beta": "float",
    "num_iterations": "int",
    "epsilon": "float",
    "delta": "float | None",
    "epsilon_high": "float | None",
    "sapo_temperature_neg": "float",
    "sapo_temperature_pos": "float",
    "vespo_k_pos": "float",
    "vespo_lambda_pos": "float",
    "vespo_k_neg": "float",
    "vespo_lambda_neg": "float",
    "importance_sampling_level": "str",
    "reward_weights": "list[float] | None",
    "multi_objective_aggregation": "str",
    "scale_rewards": "str",
    "loss_type": "str",
    "mask_truncated_completions": "bool",
    "sync_ref_model": "bool",
    "ref_model_mixup_alpha": "float",
    "ref_model_sync_steps": "int",
    "top_entropy_quantile": "float",
    "entropy_coef": "float",
    "use_adaptive_entropy": "bool",
    "entropy_coef_min": "float",
    "entropy_coef_max": "float",
    "entropy_coef_delta": "float",
    "entropy_target": "float",
    "max_tool_calling_iterations": "int | None",
    "vllm_importance_sampling_correction": "bool",
    "vllm_importance_sampling_mode": "str",
    "vllm_importance_sampling_clip_max": "float | None",
    "vllm_importance_sampling_clip_min": "float | None",
    "off_policy_mask_threshold": "float | None",
    "use_bias_correction_kl": "bool",
    "log_completions": "bool",
    "log_multimodal": "bool",
    "num_completions_to_print": "int | None",
    "log_unique_prompts": "bool",
    "log_completions_hub_repo": "str | None",
    "use_transformers_continuous_batching": "bool",
    "transformers_continuous_batching_config": "dict | str | None",
    "use_transformers_paged": "bool",
    "vllm_importance_sampling_cap": "float | None",
}

FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
TA_FIELDS = {f.name: f for f in dataclasses.fields(TrainingArguments)}
GRPO_ONLY = [name for name in SPEC_DEFAULTS if name not in TA_FIELDS]
OVERRIDDEN = {"learning_rate", "gradient_checkpointing", "logging_steps", "bf16", "remove_unused_columns"}


def declared_annotations(cls: type) -> dict[str, Any]:
    """The fields posttrain's classes declare (GRPOConfig and the shared BaseConfig), not ClassVars.

    The classes' own annotations, not Field.type: HfArgumentParser rewrites Field.type in place.
    """
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, TrainingArguments) and klass is not TrainingArguments:
            out.update(
                {k: v for k, v in vars(klass).get("__annotations__", {}).items() if not k.startswith("_")}
            )
    return out


DECLARED = declared_annotations(GRPOConfig)


def make(tmp_path, **kwargs: Any) -> GRPOConfig:
    """Build a config for a CPU test run: output in tmp_path, bf16 off unless the test sets it."""
    kwargs.setdefault("bf16", False)
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def render(annotation: Any) -> str:
    """Write an annotation the way the spec does (``int``, ``dict | str | None``)."""
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


# ---- the spec contract -------------------------------------------------------------------------


def test_public_import() -> None:
    assert posttrain.GRPOConfig is GRPOConfig
    assert issubclass(GRPOConfig, TrainingArguments)


def test_field_set_equals_spec() -> None:
    assert len(SPEC_DEFAULTS) == 191
    extensions = set(FIELDS) - set(SPEC_DEFAULTS)
    assert extensions == set(POSTTRAIN_EXTENSIONS) | set(core_config.BASE_EXTENSIONS), (
        "fields neither in the spec nor declared as extensions"
    )
    assert set(SPEC_DEFAULTS) - set(FIELDS) == set(), "spec parameters missing from GRPOConfig"


@pytest.mark.parametrize("name", list(SPEC_DEFAULTS))
def test_default_matches_spec(name: str) -> None:
    actual, expected = field_default(FIELDS[name]), SPEC_DEFAULTS[name]
    assert actual == expected
    assert type(actual) is type(expected)


@pytest.mark.parametrize("name", list(SPEC_ANNOTATIONS))
def test_annotation_matches_spec(name: str) -> None:
    assert render(DECLARED[name]) == SPEC_ANNOTATIONS[name]


def test_declares_only_grpo_fields_and_changed_defaults() -> None:
    declared = set(DECLARED)
    # transformers < 5.20 lacks activation_checkpointing*; the base config declares them there
    compat = (
        set()
        if core_config.HAS_ACTIVATION_CHECKPOINTING
        else {"activation_checkpointing", "activation_checkpointing_kwargs"}
    )
    assert declared - compat == set(SPEC_ANNOTATIONS) | set(POSTTRAIN_EXTENSIONS) | set(
        core_config.BASE_EXTENSIONS
    )
    assert declared & set(TA_FIELDS) == OVERRIDDEN
    for name in OVERRIDDEN:  # each override really changes the transformers default
        assert field_default(TA_FIELDS[name]) != SPEC_DEFAULTS[name], name


@pytest.mark.parametrize("name", [*GRPO_ONLY, *sorted(OVERRIDDEN), *POSTTRAIN_EXTENSIONS])
def test_field_has_help_and_docstring_entry(name: str) -> None:
    assert FIELDS[name].metadata.get("help", "").strip(), f"{name} has no help text"
    assert f"{name} (`" in GRPOConfig.__doc__, f"{name} is not documented in the class docstring"


# ---- changed TrainingArguments defaults ----------------------------------------------------------


def test_changed_defaults_after_construction(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecation warning from the defaults
        config = make(tmp_path)
    assert config.learning_rate == 1e-6
    assert config.logging_steps == 10
    assert config.gradient_checkpointing is True
    assert config.activation_checkpointing is True
    assert config.remove_unused_columns is False
    assert config.report_to == []


def test_warmup_ratio_runs_as_a_fractional_warmup_steps(tmp_path) -> None:
    """transformers 5 removed warmup_ratio (the reference raises TypeError on it); posttrain passes it on."""
    config = make(tmp_path, warmup_ratio=0.1)
    assert config.warmup_steps == 0.1 and config.get_warmup_steps(1000) == 100
    with pytest.raises(ValueError, match="warmup_ratio=0.1 and warmup_steps=5 are both set"):
        make(tmp_path, warmup_ratio=0.1, warmup_steps=5)
    with pytest.raises(
        ValueError, match=r"warmup_ratio=1.5 is invalid: it must be None or a number in \[0, 1\)"
    ):
        make(tmp_path, warmup_ratio=1.5)


def test_gradient_checkpointing_can_be_turned_off(tmp_path) -> None:
    assert make(tmp_path, gradient_checkpointing=False).activation_checkpointing is False
    assert make(tmp_path, activation_checkpointing=False).gradient_checkpointing is False


def test_output_dir_none_uses_trainer_output() -> None:
    config = GRPOConfig(output_dir=None, use_cpu=True, bf16=False)
    assert config.output_dir == "trainer_output"


@pytest.mark.parametrize(
    ("native", "says"),
    [(True, "has bf16 instructions: a GRPO step measured about 0.7x"), (False, "are emulated")],
)
def test_bf16_resolves_to_true_without_fp16(tmp_path, monkeypatch, native, says) -> None:
    # use_cpu=True: the warning names what bf16 costs on this kind of CPU, and the way back to float32
    monkeypatch.setattr(core_config, "native_bf16", lambda: native)
    with pytest.warns(UserWarning, match="resolved to True") as caught:
        config = make(tmp_path, bf16=None)
    message = next(str(w.message) for w in caught if "resolved to True" in str(w.message))
    assert says in message and "Pass bf16=False" in message
    assert config.bf16 is True
    assert config.mixed_precision == "bf16"


def test_bf16_resolves_to_false_with_fp16(tmp_path) -> None:
    config = make(tmp_path, bf16=None, fp16=True)
    assert config.bf16 is False
    assert config.fp16 is True


def test_bf16_explicit_value_is_kept(tmp_path) -> None:
    assert make(tmp_path, bf16=False).bf16 is False
    assert make(tmp_path, bf16=True).bf16 is True


def test_bf16_falls_back_when_machine_lacks_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(core_config, "bf16_supported", lambda use_cpu: False)
    assert make(tmp_path, bf16=None).bf16 is False


# ---- validation -------------------------------------------------------------------------------

INVALID_VALUES = [
    ("num_generations", 1),
    ("num_generations", 0),
    ("num_generations", None),
    ("num_generations_eval", 0),
    ("max_completion_length", 0),
    ("max_completion_length", None),
    ("per_device_train_batch_size", 0),
    ("gradient_accumulation_steps", 0),
    ("pad_to_multiple_of", 0),
    ("pad_to_multiple_of", "max"),
    ("generation_batch_size", 0),
    ("steps_per_generation", 0),
    ("temperature", 0.0),
    ("temperature", -1.0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("epsilon", -0.1),
    ("epsilon_high", -0.1),
    ("beta", -0.1),
    ("num_iterations", 0),
    ("top_entropy_quantile", -0.1),
    ("top_entropy_quantile", 1.5),
    ("reward_weights", [1.0, "high"]),
    ("reward_weights", [1.0, None]),
    ("reward_weights", 1.0),
    ("loss_type", "ppo"),
    ("scale_rewards", "std"),
    ("importance_sampling_level", "sentence"),
    ("multi_objective_aggregation", "mean"),
    ("vllm_importance_sampling_mode", "clip"),
    ("vllm_mode", "remote"),
    ("vllm_model_impl", "hf"),
]


@pytest.mark.parametrize(("name", "value"), INVALID_VALUES)
def test_invalid_value_raises_naming_parameter_and_value(tmp_path, name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is invalid")) as err:
        make(tmp_path, **{name: value})
    assert "must be" in str(err.value)


@pytest.mark.parametrize("name", list(CHOICES))
def test_choice_error_lists_allowed_values(tmp_path, name: str) -> None:
    with pytest.raises(ValueError, match=name) as err:
        make(tmp_path, **{name: "bogus"})
    for allowed in CHOICES[name]:
        assert repr(allowed) in str(err.value)


def test_num_generations_error_explains_group_baseline(tmp_path) -> None:
    with pytest.raises(ValueError, match="num_generations=1") as err:
        make(tmp_path, num_generations=1)
    assert "group baseline" in str(err.value)


@pytest.mark.parametrize("loss_type", [n for n, spec in OBJECTIVES.items() if spec.levels == ("sequence",)])
def test_luspo_requires_sequence_level(tmp_path, loss_type) -> None:
    """Every sequence-only loss (luspo) refuses the default token level, naming the fix."""
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' is a sequence-level loss.*'sequence'"):
        make(tmp_path, loss_type=loss_type)


def test_validation_runs_before_trainingarguments_setup(tmp_path, monkeypatch) -> None:
    def unreachable(self) -> None:
        raise AssertionError("TrainingArguments.__post_init__ ran before validation")

    monkeypatch.setattr(TrainingArguments, "__post_init__", unreachable)
    with pytest.raises(ValueError, match="temperature"):
        make(tmp_path, temperature=0.0)
    with pytest.raises(NotImplementedError, match="log_completions_hub_repo"):
        make(tmp_path, log_completions_hub_repo="user/completions")


def test_mutually_exclusive_batch_options(tmp_path) -> None:
    with pytest.raises(ValueError, match="generation_batch_size=16 and steps_per_generation=1") as err:
        make(tmp_path, generation_batch_size=16, steps_per_generation=1)
    assert "mutually exclusive" in str(err.value)


def test_generation_batch_not_multiple_of_global_batch(tmp_path) -> None:
    with pytest.raises(ValueError, match="generation_batch_size=12 is not a multiple") as err:
        make(tmp_path, per_device_train_batch_size=8, generation_batch_size=12, num_generations=4)
    assert "per_device_train_batch_size x world_size = 8 x 1 = 8" in str(err.value)
    assert "such as 8 or 16" in str(err.value)


def test_generation_batch_not_multiple_of_num_generations(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a multiple of num_generations=8") as err:
        make(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3)
    message = str(err.value)
    assert "generation_batch_size=12" in message
    assert "steps_per_generation=3 (from gradient_accumulation_steps)" in message
    assert "set steps_per_generation=4 (generation_batch_size=16)" in message
    assert "num_generations in [2, 3, 4, 6, 12]" in message


def test_explicit_generation_batch_not_multiple_of_num_generations(tmp_path) -> None:
    with pytest.raises(ValueError, match="generation_batch_size=24 .* num_generations=16"):
        make(tmp_path, per_device_train_batch_size=8, generation_batch_size=24, num_generations=16)


# ---- options not built yet --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(UNBUILT_OPTIONS))
def test_unbuilt_option_raises(tmp_path, name: str) -> None:
    row = UNBUILT_OPTIONS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated flags warn too
        with pytest.raises(NotImplementedError, match=re.escape(f"{name}={row.example!r}")) as err:
            make(tmp_path, **{name: row.example})
    assert f"(planned: {row.feature})" in str(err.value)
    assert row.fix in str(err.value)


@pytest.mark.parametrize("name", list(UNBUILT_OPTIONS))
def test_unbuilt_option_default_is_the_spec_default_and_works(name: str) -> None:
    row = UNBUILT_OPTIONS[name]
    assert row.default == SPEC_DEFAULTS[name]
    assert not row.is_unbuilt(row.default)
    assert row.is_unbuilt(row.example)


def test_unbuilt_message_format(tmp_path) -> None:
    with pytest.raises(NotImplementedError) as err:
        make(tmp_path, log_completions_hub_repo="user/completions")
    assert str(err.value) == (
        "log_completions_hub_repo='user/completions' is not implemented yet in posttrain (planned: completion "
        "upload to the Hub). Leave log_completions_hub_repo=None."
    )


def test_unbuilt_error_lists_every_offending_option(tmp_path) -> None:
    from posttrain import SDFTConfig

    with pytest.raises(NotImplementedError) as err:
        SDFTConfig(output_dir=str(tmp_path), generate_from_teacher=True, use_teacher_server=True)
    assert "generate_from_teacher=True" in str(err.value)
    assert "use_teacher_server=True" in str(err.value)


def test_use_vllm_is_built_for_grpo(tmp_path) -> None:
    assert (
        make(tmp_path, use_vllm=True).use_vllm is True
    )  # the trainer then needs vllm (tests/test_vllm_backend.py)


def test_docs_list_exactly_the_unbuilt_options() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    section = docs.split("## Options not built yet", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert listed == list(UNBUILT_OPTIONS)


@pytest.mark.parametrize("loss_type", [n for n, spec in OBJECTIVES.items() if "token" in spec.levels])
def test_built_loss_types_are_accepted(tmp_path, loss_type) -> None:
    assert make(tmp_path, loss_type=loss_type).loss_type == loss_type


@pytest.mark.parametrize("loss_type", [n for n, spec in OBJECTIVES.items() if spec.levels == ("token",)])
def test_token_level_only_losses_reject_sequence_level(tmp_path, loss_type) -> None:
    with pytest.raises(ValueError, match="importance_sampling_level='token'"):
        make(tmp_path, loss_type=loss_type, importance_sampling_level="sequence")


def test_empty_fsdp_is_not_fsdp(tmp_path) -> None:
    assert make(tmp_path, fsdp="").fsdp == ""


# ---- normalisation ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", JSON_DICT_FIELDS)
def test_json_string_dict_is_parsed(tmp_path, name: str) -> None:
    config = make(tmp_path, **{name: '{"dtype": "bfloat16", "n": 2, "flag": true}'})
    assert getattr(config, name) == {"dtype": "bfloat16", "n": 2, "flag": True}


@pytest.mark.parametrize("name", JSON_DICT_FIELDS)
def test_dict_passes_through(tmp_path, name: str) -> None:
    assert getattr(make(tmp_path, **{name: {"a": 1}}), name) == {"a": 1}


@pytest.mark.parametrize(("value", "problem"), [("{not json", "not valid JSON"), ("[1, 2]", "not an object")])
def test_bad_json_string_raises(tmp_path, value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=f"model_init_kwargs=.*{problem}"):
        make(tmp_path, model_init_kwargs=value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, "group"),
        (False, "none"),
        ("true", "group"),
        ("True", "group"),
        ("false", "none"),
        ("FALSE", "none"),
        ("group", "group"),
        ("batch", "batch"),
        ("none", "none"),
    ],
)
def test_scale_rewards_normalisation(tmp_path, value: Any, expected: str) -> None:
    assert make(tmp_path, scale_rewards=value).scale_rewards == expected


def test_pad_to_multiple_of_digit_string_becomes_int(tmp_path) -> None:
    assert make(tmp_path, pad_to_multiple_of="64").pad_to_multiple_of == 64


def test_deprecated_paged_flag_turns_on_continuous_batching(tmp_path) -> None:
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        config = make(tmp_path, use_transformers_paged=True)
    assert config.use_transformers_continuous_batching is True


def test_deprecated_importance_sampling_cap(tmp_path) -> None:
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        config = make(tmp_path, vllm_importance_sampling_cap=2.0)
    assert config.vllm_importance_sampling_clip_max == 2.0


# ---- derived batch quantities -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("per_device", "grad_acc", "world", "gen_batch", "steps", "num_gen", "expected_batch", "expected_steps"),
    [
        (8, 1, 1, None, None, 8, 8, 1),  # the defaults
        (4, 3, 1, None, None, 6, 12, 3),  # steps_per_generation from gradient_accumulation_steps
        (2, 1, 4, None, None, 8, 8, 1),  # four processes share one group per step
        (4, 2, 1, None, 4, 8, 16, 4),  # explicit steps_per_generation wins over grad_acc
        (4, 1, 2, 32, None, 8, 32, 4),  # generation_batch_size / (4 x 2)
        (8, 1, 1, 24, None, 6, 24, 3),
        (4, 1, 1, 8, 2, 8, 8, 2),  # both given and consistent: a copy of a built config
    ],
)
def test_generation_batch_derivation(
    tmp_path,
    monkeypatch,
    per_device: int,
    grad_acc: int,
    world: int,
    gen_batch: int | None,
    steps: int | None,
    num_gen: int,
    expected_batch: int,
    expected_steps: int,
) -> None:
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: world))
    config = make(
        tmp_path,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=grad_acc,
        generation_batch_size=gen_batch,
        steps_per_generation=steps,
        num_generations=num_gen,
    )
    assert (config.generation_batch_size, config.steps_per_generation) == (expected_batch, expected_steps)


def test_world_size_enters_divisibility(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=re.escape("4 x 2 = 8")):
        make(tmp_path, per_device_train_batch_size=4, generation_batch_size=12, num_generations=4)


def test_num_generations_eval_defaults_to_num_generations(tmp_path) -> None:
    assert make(tmp_path, num_generations=4).num_generations_eval == 4
    assert make(tmp_path, num_generations=4, num_generations_eval=1).num_generations_eval == 1


def test_replace_keeps_a_built_config_valid(tmp_path) -> None:
    config = make(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
    copy = dataclasses.replace(config, learning_rate=2e-6)
    assert (copy.generation_batch_size, copy.steps_per_generation) == (8, 2)


# ---- command line -----------------------------------------------------------------------------


def test_command_line_parsing(tmp_path) -> None:
    parser = HfArgumentParser(GRPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path),
            "--use_cpu",
            "--bf16", "false",
            "--scale_rewards", "false",
            "--model_init_kwargs", '{"dtype": "float32"}',
            "--reward_weights", "1.0", "0.5",
            "--pad_to_multiple_of", "64",
            "--num_generations", "4",
        ]
    )  # fmt: skip
    assert config.scale_rewards == "none"
    assert config.model_init_kwargs == {"dtype": "float32"}
    assert config.reward_weights == [1.0, 0.5]
    assert config.pad_to_multiple_of == 64
    assert config.num_generations == 4
    assert config.generation_batch_size == 8
