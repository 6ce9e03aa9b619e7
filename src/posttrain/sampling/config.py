"""The configuration shared by every trainer that samples from the policy: ``OnlineConfig``.

GRPO, RLOO and the online trainers that follow share the reference's generation, vLLM,
reference-model, reward, logging and tool options, the generation-batch arithmetic
(``generation_batch_size`` / ``steps_per_generation``) and their checks. They live here once;
a family's config (``GRPOConfig``, ``RLOOConfig``) subclasses ``OnlineConfig``, adds its own
fields and rules, and overrides a default where the reference's differs (RLOO:
``num_generations=2``, ``beta=0.05``). Each field is documented in the family configs'
docstrings, which are what users read.
"""

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import (
    BaseConfig,
    Rule,
    UnbuiltOption,
    choice_rules,
    is_int,
    is_num,
    optional,
    positive_int,
)

__all__ = [
    "ONLINE_CHOICES",
    "ONLINE_RULES",
    "ONLINE_UNBUILT",
    "JSON_DICT_FIELDS",
    "OnlineConfig",
    "SAMPLING_EXTENSIONS",
]

#: Options accepted by every online config but not built yet (one row per option; a family's
#: config adds its own). vLLM generation (``use_vllm``) is built for every online trainer.
ONLINE_UNBUILT: dict[str, UnbuiltOption] = {}

#: Allowed values of the shared string-valued choice parameters.
ONLINE_CHOICES: dict[str, tuple[str, ...]] = {
    "vllm_mode": ("server", "colocate"),
    "vllm_model_impl": ("transformers", "vllm"),
    "reward_fault_policy": ("raise", "skip"),
    "dynamic_sampling_prefer": ("first", "hardest"),
}

#: Parameters that take a dict and may arrive from the command line as a JSON string.
JSON_DICT_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "transformers_continuous_batching_config",
    "vllm_engine_kwargs",
)

#: Fields every online config adds to the reference's (each family's ``POSTTRAIN_EXTENSIONS``).
SAMPLING_EXTENSIONS = ("vllm_engine_kwargs", "vllm_lora_sync")

# One row per parameter: name, is the value ok?, what it must be, how to fix it.
# fmt: off
ONLINE_RULES: tuple[Rule, ...] = (
    Rule("num_generations", lambda v: is_int(v) and v >= 2, "an integer >= 2, because the group baseline compares each completion with the other completions of its prompt", "set num_generations=2 or more"),
    Rule("num_generations_eval", optional(positive_int), "None or an integer >= 1", "set num_generations_eval to a positive integer, or to None to reuse num_generations"),
    Rule("max_completion_length", positive_int, "a positive integer (the most tokens a completion may have)", "set max_completion_length to a positive integer such as 512 (the default)"),
    Rule("per_device_train_batch_size", positive_int, "a positive integer", "set per_device_train_batch_size to 1 or more"),
    Rule("gradient_accumulation_steps", positive_int, "a positive integer", "set gradient_accumulation_steps to 1 or more"),
    Rule("pad_to_multiple_of", optional(lambda v: v == "auto" or positive_int(v)), "None, 'auto' or a positive integer", "set pad_to_multiple_of to a positive integer such as 64, to 'auto' (the default) or to None"),
    Rule("generation_batch_size", optional(positive_int), "None or a positive integer", "set generation_batch_size to a positive multiple of num_generations, or leave it None"),
    Rule("steps_per_generation", optional(positive_int), "None or a positive integer", "set steps_per_generation to 1 or more, or leave it None to use gradient_accumulation_steps"),
    Rule("temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set temperature to a positive value such as 1.0 (the default)"),
    Rule("top_p", lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1]", "set top_p to a value in (0, 1], or to 1.0 to keep all tokens"),
    Rule("top_k", lambda v: is_int(v) and v >= 0, "an integer >= 0", "set top_k to a non-negative integer, or to 0 to disable top-k filtering"),
    Rule("min_p", optional(lambda v: is_num(v) and 0 <= v <= 1), "None or a number in [0, 1]", "set min_p to a value in [0, 1] such as 0.05, or leave it None"),
    Rule("epsilon", lambda v: is_num(v) and v >= 0, "a number >= 0", "set epsilon to a non-negative clipping range such as 0.2 (the default)"),
    Rule("epsilon_high", optional(lambda v: is_num(v) and v >= 0), "None or a number >= 0", "set epsilon_high to a non-negative value such as 0.28, or leave it None to reuse epsilon"),
    Rule("beta", lambda v: is_num(v) and v >= 0, "a number >= 0", "set beta to 0.0 (no KL term) or to a positive KL coefficient"),
    Rule("num_iterations", positive_int, "an integer >= 1", "set num_iterations to 1 (the default) or more"),
    Rule("ref_model_mixup_alpha", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]", "set ref_model_mixup_alpha in [0, 1] (the default is 0.6)"),
    Rule("ref_model_sync_steps", positive_int, "an integer >= 1", "set ref_model_sync_steps to 1 or more (the default is 512)"),
    Rule("reward_timeout", optional(lambda v: is_num(v) and v > 0), "None or a number of seconds > 0", "set reward_timeout to a positive number of seconds, or None for no limit"),
    Rule("vllm_gpu_memory_utilization", lambda v: is_num(v) and 0 < v <= 1, "a fraction in (0, 1] of each GPU's memory", "set vllm_gpu_memory_utilization to a fraction such as 0.3 (the default)"),
    Rule("vllm_tensor_parallel_size", positive_int, "an integer >= 1", "set vllm_tensor_parallel_size to 1 (the default) or to a divisor of the number of training processes"),
    Rule("vllm_server_timeout", lambda v: is_num(v) and v > 0, "a number of seconds > 0", "set vllm_server_timeout to a positive number of seconds such as 240 (the default)"),
    Rule("vllm_server_port", lambda v: is_int(v) and 0 < v < 65536, "a TCP port in 1..65535", "set vllm_server_port to the port of the vLLM server (the default is 8000)"),
    Rule("vllm_group_port", lambda v: is_int(v) and 0 < v < 65536, "a TCP port in 1..65535", "set vllm_group_port to a free port (the default is 51216)"),
    Rule("vllm_max_model_length", optional(positive_int), "None or a positive integer", "set vllm_max_model_length to at least the longest prompt plus max_completion_length, or leave it None"),
    Rule("dynamic_sampling_max_rounds", positive_int, "an integer >= 1", "set dynamic_sampling_max_rounds to 1 or more (the default is 3)"),
    Rule("dynamic_sampling_oversample", positive_int, "an integer >= 1", "set dynamic_sampling_oversample to 1 (no over-sampling, the default) or more, such as 4"),
    Rule("reward_weights", optional(lambda v: isinstance(v, (list, tuple)) and all(is_num(w) for w in v)), "None or a list of numbers, one per reward function", "pass a list of floats such as [1.0, 0.5], or None to weight every reward function 1.0"),
) + choice_rules(ONLINE_CHOICES)
# fmt: on


def _divisors_near(n: int, target: int, count: int = 6) -> list[int]:
    """Up to ``count`` divisors of ``n`` that are >= 2 and closest to ``target``, ascending."""
    divisors = [d for d in range(2, n + 1) if n % d == 0]
    return sorted(sorted(divisors, key=lambda d: abs(d - target))[:count])


@dataclass
class OnlineConfig(BaseConfig):
    """The fields and checks every online trainer's config shares (see the module docstring).

    Not used on its own: ``GRPOConfig`` and ``RLOOConfig`` document each field.
    """

    learning_rate: float = field(
        default=1e-6, metadata={"help": "Initial learning rate of the optimizer (AdamW by default)."}
    )
    remove_unused_columns: bool | None = field(
        default=False,
        metadata={
            "help": "Keep only the 'prompt' column of the dataset. Leave False when a reward function "
            "reads other columns."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the MoE load-balancing auxiliary loss; None uses the model config's "
            "value, 0.0 disables it. Fails on non-MoE models."
        },
    )
    disable_dropout: bool = field(
        default=False, metadata={"help": "Disable dropout so log-probabilities are deterministic."}
    )
    num_generations: int | None = field(
        default=8,
        metadata={
            "help": "Completions sampled per prompt (group size); at least 2 and a divisor of "
            "generation_batch_size."
        },
    )
    num_generations_eval: int | None = field(
        default=None,
        metadata={"help": "Completions per prompt during evaluation; None uses num_generations."},
    )
    max_completion_length: int | None = field(
        default=512, metadata={"help": "Maximum number of tokens in a generated completion."}
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "With DeepSpeed ZeRO-3, gather the policy weights for faster generation; disable "
            "to fit models larger than one GPU (slower, not compatible with vLLM)."
        },
    )
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the training dataset."})
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "Pad prompt and completion ids to a multiple of this value; 'auto' pads to 128 on "
            "AWS Neuron and not at all elsewhere."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated at once across all processes; None means "
            "per_device_train_batch_size * num_processes * steps_per_generation. Exclusive with "
            "steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps fed by one generation batch; None means gradient_accumulation_steps. "
            "Exclusive with generation_batch_size."
        },
    )
    temperature: float = field(
        default=1.0, metadata={"help": "Sampling temperature; higher gives more random completions."}
    )
    top_p: float = field(
        default=1.0,
        metadata={"help": "Nucleus sampling probability mass, in (0, 1]; 1.0 keeps all tokens."},
    )
    top_k: int = field(
        default=0, metadata={"help": "Keep only the top_k most likely tokens; 0 disables the filter."}
    )
    min_p: float | None = field(
        default=None,
        metadata={
            "help": "Minimum token probability relative to the most likely token, in [0, 1] "
            "(typically 0.01-0.2); None disables it."
        },
    )
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra generation keyword arguments (dict or JSON object string) for the "
            "generation config or vLLM SamplingParams; they win over the other sampling options."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments (dict or JSON object string) for apply_chat_template "
            "when building prompts."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "Penalty on tokens already in the prompt or completion; > 1.0 favours new tokens, "
            "< 1.0 repetition."
        },
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={"help": "KV-cache implementation for transformers generation (without vLLM)."},
    )
    use_vllm: bool = field(
        default=False,
        metadata={"help": "Generate completions with vLLM instead of model.generate(); needs vllm."},
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'server' sends requests to a separate vLLM server; 'colocate' runs vLLM inside "
            "the training processes."
        },
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={"help": "Model implementation used by vLLM: 'vllm' or 'transformers'."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Let vLLM release weights and cache during the optimizer step (less GPU memory, "
            "wake-up latency)."
        },
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None,
        metadata={"help": "Regex for vLLM structured outputs; None disables them."},
    )
    vllm_lora_sync: bool | None = field(
        default=None,
        metadata={
            "help": "With a LoRA (PEFT) policy: vLLM serves the adapter (enable_lora; a server started "
            "with --enable-lora) and each weight push sends only the adapter, not the merged model; the "
            "engine's base stays the trainer's. False: the adapters are merged into the base and every "
            "weight is pushed. None (default): adapter-only in colocate mode where vLLM can serve the "
            "adapter alone, the merged push otherwise."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of the vLLM server (e.g. http://localhost:8000); overrides host and port."
        },
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Host of the vLLM server."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Port of the vLLM server."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={"help": "Seconds to wait for the vLLM server to come up before raising ConnectionError."},
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={"help": "Port of the weight-update process group shared with the vLLM server."},
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Fraction of GPU memory the colocated vLLM engine may use (pass it to the server "
            "in server mode)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "vLLM context window, at least the longest prompt plus max_completion_length; None "
            "reads it from the model config."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Tensor-parallel size of the colocated vLLM engine (pass it to the server in "
            "server mode)."
        },
    )
    vllm_engine_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments for the colocated vllm.LLM (dict or JSON object string), "
            "e.g. {'enforce_eager': true}; they win over posttrain's, 'dtype' included (the trainer's "
            "compute dtype by default)."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient; 0.0 skips the reference model (less memory, faster)."},
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Optimisation passes over each generation batch (mu)."}
    )
    epsilon: float = field(default=0.2, metadata={"help": "Clipping range of the importance ratio."})
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clipping range; None reuses epsilon. DAPO recommends 0.28; for cispo it is "
            "epsilon_max (default 5.0)."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward function; None weights every function 1.0."},
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Exclude truncated completions from the loss (recommended by DAPO)."},
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Mix the policy into the reference model every ref_model_sync_steps steps (TR-DPO)."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={
            "help": "TR-DPO alpha: ref = alpha * policy + (1 - alpha) * ref_prev; needs sync_ref_model."
        },
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={"help": "TR-DPO tau: steps between reference syncs; needs sync_ref_model."},
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "Maximum tool-calling turns when training an agent; None is unlimited."},
    )
    log_completions: bool = field(
        default=False,
        metadata={"help": "Log a sample of (prompt, completion) pairs every logging_steps steps."},
    )
    log_multimodal: bool = field(
        default=True, metadata={"help": "Log images and other media alongside completions."}
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Completions printed with rich; None prints all."}
    )
    log_unique_prompts: bool = field(default=False, metadata={"help": "Log each distinct prompt only once."})
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={"help": "Generate with the transformers continuous-batching engine (transformers >= 5.8)."},
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments (dict or JSON object string) for ContinuousBatchingConfig."},
    )
    use_transformers_paged: bool = field(
        default=False,
        metadata={"help": "Deprecated: use use_transformers_continuous_batching instead."},
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling: replace groups whose rewards all agree by groups with spread "
            "generated from further prompts."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={"help": "Most extra generation rounds per generation batch for dynamic_sampling."},
    )
    dynamic_sampling_oversample: int = field(
        default=1,
        metadata={
            "help": "dynamic_sampling samples this many times the prompts the batch needs in each round, "
            "in one generation call, and trains on the groups with spread it prefers (1: no over-sampling)."
        },
    )
    dynamic_sampling_prefer: str = field(
        default="first",
        metadata={
            "help": "Which groups with spread dynamic_sampling trains on: 'first' (in sampling order, DAPO's) "
            "or 'hardest' (lowest mean reward first)."
        },
    )
    reward_fault_policy: str = field(
        default="raise",
        metadata={
            "help": "A reward function that raises, returns NaN/inf or times out: 'raise' (stop with an error "
            "naming it) or 'skip' (leave those rewards out and count them)."
        },
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={"help": "Seconds an async reward function may take per call; None: no limit."},
    )

    _rules: ClassVar[tuple[Rule, ...]] = ONLINE_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ONLINE_UNBUILT
    _json_dict_fields: ClassVar[tuple[str, ...]] = JSON_DICT_FIELDS

    # ---- hooks of BaseConfig.__post_init__ ----------------------------------------------------

    def _normalise_family(self) -> None:
        """A digit string ``pad_to_multiple_of`` (from the command line), deprecated parameters."""
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of.isdigit():
            self.pad_to_multiple_of = int(self.pad_to_multiple_of)
        if self.use_transformers_paged:
            warnings.warn(
                "`use_transformers_paged` is deprecated and will be removed; use "
                "`use_transformers_continuous_batching=True` instead.",
                FutureWarning,
                stacklevel=5,
            )
            self.use_transformers_continuous_batching = True

    #: Shared fields a family does not use: the values each may hold (the first is the default; a
    #: built config's derived value is accepted too, so a copy rebuilds) and why (online DPO, A*-PO).
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = {}
    #: The family's name in the messages about ``_off_fields``.
    _method: ClassVar[str] = "this trainer"

    def _check_combinations(self) -> None:
        """The shared combinations that cannot work (each parameter passed its rule already)."""
        for name, (allowed, why) in self._off_fields.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} does not apply to {self._method} ({why}); leave it at "
                    f"{allowed[0]!r}."
                )
        chooses = {"dynamic_sampling_oversample": 1, "dynamic_sampling_prefer": "first"}
        for name, default in chooses.items():
            if getattr(self, name) != default and not self.dynamic_sampling:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} shapes dynamic sampling, which is off; set "
                    f"dynamic_sampling=True, or leave {name} at {default!r}."
                )
        if self.vllm_lora_sync is True and not self.use_vllm:
            raise ValueError(
                "vllm_lora_sync=True pushes LoRA adapters to vLLM, but use_vllm=False; set use_vllm=True."
            )
        if self.use_vllm and self.vllm_mode == "colocate" and self.vllm_enable_sleep_mode:
            from posttrain.generation.vllm_backend import sleep_mode_refusal

            refusal = sleep_mode_refusal()
            if refusal is not None:
                raise ValueError(refusal)
        if self.sync_ref_model and self.beta == 0:
            raise ValueError(
                "sync_ref_model=True updates the reference model of the KL penalty, but beta=0 means there is "
                "no reference model; set beta > 0 (e.g. 0.04) or sync_ref_model=False."
            )

    def _derive(self) -> None:
        """The generation batch values, which depend on the world size."""
        self._derive_generation_batch()

    def _derive_generation_batch(self) -> None:
        """Fill ``num_generations_eval``, ``steps_per_generation`` and ``generation_batch_size``.

        ``generation_batch_size = per_device_train_batch_size * world_size * steps_per_generation``;
        whichever of the two is unset follows from the other (``steps_per_generation`` defaults to
        ``gradient_accumulation_steps``). A config that already carries both (a copy of a built
        config) is accepted when they agree.
        """
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        per_step = self.per_device_train_batch_size * self.world_size
        per_step_text = (
            f"per_device_train_batch_size x world_size = {self.per_device_train_batch_size} x "
            f"{self.world_size} = {per_step}"
        )
        gbs, spg = self.generation_batch_size, self.steps_per_generation
        if gbs is not None and spg is not None and gbs != per_step * spg:
            raise ValueError(
                f"generation_batch_size={gbs} and steps_per_generation={spg} are mutually exclusive "
                f"({per_step_text}, so steps_per_generation={spg} already means generation_batch_size="
                f"{per_step * spg}); set only one of them."
            )
        spg_text = f"steps_per_generation={spg}"
        if gbs is None:
            if spg is None:
                spg = self.gradient_accumulation_steps
                spg_text = f"steps_per_generation={spg} (from gradient_accumulation_steps)"
            gbs = per_step * spg
        elif gbs % per_step != 0:
            both = math.lcm(per_step, self.num_generations)
            nearby = [m for m in (gbs // both * both, (gbs // both + 1) * both) if m > 0]
            raise ValueError(
                f"generation_batch_size={gbs} is not a multiple of {per_step_text}; set it to a multiple "
                f"of both {per_step} and num_generations={self.num_generations}, such as "
                f"{' or '.join(map(str, nearby))}, or set steps_per_generation instead."
            )
        else:
            spg = gbs // per_step
            spg_text = f"steps_per_generation={spg}"
        self.generation_batch_size, self.steps_per_generation = gbs, spg
        if gbs % self.num_generations != 0:
            raise ValueError(
                _group_split_message(
                    gbs, f"{per_step_text}, times {spg_text}", per_step, spg, self.num_generations
                )
            )
        per_process = self.per_device_train_batch_size * spg
        if self.dynamic_sampling and per_process % self.num_generations != 0:
            raise ValueError(
                f"dynamic_sampling=True refills each process's own groups, so the per-process generation "
                f"batch (per_device_train_batch_size x steps_per_generation = {per_process}) must be a "
                f"multiple of num_generations={self.num_generations}; raise per_device_train_batch_size "
                "or steps_per_generation, or set dynamic_sampling=False."
            )


def _group_split_message(gbs: int, how: str, per_step: int, spg: int, num_generations: int) -> str:
    """Explain why ``gbs`` completions cannot hold whole groups of ``num_generations``, with fixes.

    Args:
        gbs: The generation batch size.
        how: How ``gbs`` was computed, for the message.
        per_step: ``per_device_train_batch_size * world_size``.
        spg: The steps per generation.
        num_generations: The group size.
    """
    step = num_generations // math.gcd(num_generations, per_step)  # smallest working steps_per_generation
    good_spg = step * math.ceil(spg / step)
    divisors = _divisors_near(gbs, num_generations)
    options = f"set steps_per_generation={good_spg} (generation_batch_size={good_spg * per_step})"
    if divisors:
        options += f" or use num_generations in {divisors}"
    return (
        f"generation_batch_size={gbs} ({how}) is not a "
        f"multiple of num_generations={num_generations}, so a prompt's group of completions would be "
        f"split across generation batches; {options}."
    )
