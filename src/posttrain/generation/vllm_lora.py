"""Adapter-only weight sync (``vllm_lora_sync=True``): vLLM serves the policy's LoRA adapter.

With a merged push, every optimizer step merges the adapters into the base, sends every weight
to the engine and unmerges them again. vLLM serves LoRA adapters itself (``enable_lora``, one
``LoRARequest`` per request), so only the adapter needs to travel: the engine's base weights are
the trainer's base, loaded once, and after each optimizer step the adapter is written to a folder
(PEFT's ``save_pretrained``: a few MB) and loaded in place: by a colocated engine's ``add_lora``
with ``load_inplace``, by a server's ``/v1/load_lora_adapter`` (``vllm_server``).
A generation made while the adapters are switched off (a PEFT policy's base serving as the
reference, A*-PO's first stage) asks for the base alone. A 4-bit (QLoRA) base goes to the engine
dequantized (``base_weight_items``), so the engine computes with the trainer's quantised base and
nothing is ever merged into (and requantised from) 4-bit weights.

``adapter_sync_blocker`` names the adapters the engine cannot serve this way (another PEFT
method, DoRA, ``modules_to_save``, a bias, a rank above vLLM's largest); the config refuses
them before the engine is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.generation.base import Samples
from posttrain.generation.vllm_common import (
    samples_from_outputs,
    shutdown_engine,
    unpadded_prompts,
    weight_items,
)

#: The ranks vLLM's ``max_lora_rank`` accepts (``vllm.config.lora.MaxLoRARanks``, 0.32).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: The one adapter the engine holds (``lora_int_id`` must be at least 1), and its name.
ADAPTER_ID = 1
ADAPTER_NAME = "policy"


def _peft_config(model: torch.nn.Module) -> Any:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return configs.get(getattr(model, "active_adapter", "default"))


def adapter_sync_blocker(model: torch.nn.Module) -> str | None:
    """Why vLLM cannot serve ``model``'s adapter on its own, or None when it can."""
    config = _peft_config(model)
    if config is None:
        return "the policy is not a PEFT model (pass peft_config, or a PeftModel)"
    kind = str(getattr(config, "peft_type", ""))
    if not kind.endswith("LORA") or kind.endswith("ADALORA"):
        return f"its adapter is {kind.rsplit('.', 1)[-1]}, not LoRA"
    checks = (
        (getattr(config, "use_dora", False), "it uses DoRA"),
        (
            bool(getattr(config, "modules_to_save", None)),
            "it trains modules_to_save (full copies of modules)",
        ),
        (getattr(config, "bias", "none") != "none", f"it trains biases (bias={config.bias!r})"),
        (bool(getattr(config, "rank_pattern", None)), "it has a rank_pattern (several ranks)"),
        (
            config.r > VLLM_LORA_RANKS[-1],
            f"its rank {config.r} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}",
        ),
        (_targets_outside_decoder(config), "it adapts the embeddings or the output head"),
    )
    return next((why for failed, why in checks if failed), None)


def _targets_outside_decoder(config: Any) -> bool:
    """Whether the adapter targets ``embed_tokens`` or ``lm_head`` (vLLM serves decoder linears)."""
    targets = getattr(config, "target_modules", None) or ()
    names = {targets} if isinstance(targets, str) else set(targets)
    return any(n.rsplit(".", 1)[-1] in ("embed_tokens", "lm_head") for n in names)


def served_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def lora_engine_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords that let it serve ``model``'s adapter (rank rounded up to vLLM's)."""
    return {"enable_lora": True, "max_lora_rank": served_rank(_peft_config(model).r), "max_loras": 1}


def has_4bit_weights(model: torch.nn.Module) -> bool:
    """Whether any weight of ``model`` is a quantised bitsandbytes weight (it carries a ``quant_state``)."""
    return any(getattr(getattr(m, "weight", None), "quant_state", None) is not None for m in model.modules())


def base_weight_items(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base weights under checkpoint names, the adapter left out, for the engine's one base load.

    A 4-bit (bitsandbytes) weight goes dequantized, the values the trainer's forward multiplies
    by, so the engine's base is the trainer's quantised base and not the float checkpoint it was
    quantised from; its quantisation statistics (``weight.absmax``, ``weight.quant_map``, ...) are
    left out.
    """
    state = model.state_dict()
    dequantized = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is not None:
            from bitsandbytes.functional import dequantize_4bit

            dequantized[f"{name}.weight"] = dequantize_4bit(weight.data, quant_state).to(quant_state.dtype)
    if dequantized:
        statistics = tuple(f"{key}." for key in dequantized)
        state = {k: dequantized.get(k, v) for k, v in state.items() if not k.startswith(statistics)}
    return list(weight_items(model, state))


def adapters_enabled(model: torch.nn.Module) -> bool:
    """Whether the PEFT model's adapters take part in its forward now (not under ``disable_adapter``)."""
    return not any(getattr(m, "disable_adapters", False) for m in model.modules() if hasattr(m, "lora_A"))


class AdapterSync:
    """Writes the policy's adapter to ``folder`` and loads it into a colocated engine in place.

    Args:
        folder: where the adapter is written at each push (``{output_dir}/vllm-adapter``); in
            server mode the server reads it there (the same machine, or shared storage).
        request_class: ``vllm.lora.request.LoRARequest`` (colocate; None for a server).
        name: the adapter's name in the engine.
        adapter_id: its id in the engine (``lora_int_id``, 1 or more; distinct per adapter).
        peft_adapter: which of the PEFT model's adapters is pushed; None: the active one.
        shared: the engine this adapter shares with others (:class:`SharedEngine`: a sweep's
            runs); None: an engine of its own.
    """

    def __init__(
        self,
        folder: str,
        request_class: Any,
        name: str = ADAPTER_NAME,
        adapter_id: int = ADAPTER_ID,
        peft_adapter: str | None = None,
        shared: SharedEngine | None = None,
    ) -> None:
        self.folder = folder
        self.request_class = request_class
        self.name = name
        self.adapter_id = adapter_id
        self.peft_adapter = peft_adapter
        self.shared = shared
        self._base_loaded = False
        self.pushes = 0

    @property
    def base_loaded(self) -> bool:
        """Whether the engine holds the trainer's base weights (pushed once, by any adapter sharing it)."""
        return self.shared.base_loaded if self.shared is not None else self._base_loaded

    @base_loaded.setter
    def base_loaded(self, value: bool) -> None:
        if self.shared is not None:
            self.shared.base_loaded = value
        else:
            self._base_loaded = value

    def push(self, engine: Any, model: torch.nn.Module) -> None:
        """Save the adapter and load it into the colocated ``engine`` in place."""
        self.save(model)
        engine.llm_engine.add_lora(
            self.request_class(self.name, self.adapter_id, self.folder, load_inplace=True)
        )

    def save(self, model: torch.nn.Module) -> None:
        """Write the adapter (its files only: ``adapter_model.safetensors``, ``adapter_config.json``)."""
        os.makedirs(self.folder, exist_ok=True)
        adapter = self.peft_adapter or getattr(model, "active_adapter", "default")
        model.save_pretrained(self.folder, selected_adapters=[adapter], safe_serialization=True)
        if adapter != "default":  # PEFT writes a non-default adapter into a subfolder of its name
            source = os.path.join(self.folder, adapter)
            for name in os.listdir(source):
                os.replace(os.path.join(source, name), os.path.join(self.folder, name))
        self.pushes += 1

    def request(self, model: torch.nn.Module) -> Any:
        """The ``lora_request`` of a generation: the adapter, or None (the base) while it is off."""
        if not adapters_enabled(model):
            return None
        return self.request_class(self.name, self.adapter_id, self.folder)


class SharedEngine:
    """One engine serving several adapters of one PEFT model: a sweep's runs.

    The base weights are loaded once for all; each adapter has its own id, folder and pushes
    (:class:`AdapterSync` with ``shared=self``), and the engine holds every adapter at once
    (``max_loras``), so one call can sample each prompt with its own adapter. A colocated engine
    is built from ``engine_kwargs`` by the first run (``engine_for``); with a server (``vllm_mode
    ="server"``) only the shared base and the adapters' names and ids are kept here.

    Args:
        ranks: each adapter's name and LoRA rank, in order (their engine ids are 1, 2, ...).
    """

    def __init__(self, ranks: dict[str, int]) -> None:
        self.ids = {name: index for index, name in enumerate(ranks, start=1)}
        self.engine_kwargs: dict[str, Any] = {
            "enable_lora": True,
            "max_lora_rank": served_rank(max(ranks.values())),
            "max_loras": len(ranks),
        }
        self.engine: Any = None
        self.base_loaded = False
        #: the generators built on this engine (each forgets it when it is closed)
        self.generators: list[Any] = []

    def engine_for(self, make: Any) -> Any:
        """The engine, built by ``make()`` at the first call."""
        if self.engine is None:
            self.engine = make()
            self.base_loaded = False
        return self.engine

    def close(self) -> None:
        """Shut the engine down; a later generation builds a new one (and loads the base again)."""
        if self.engine is None:
            return
        shutdown_engine(self.engine)
        self.engine = None
        self.base_loaded = False
        for generator in self.generators:
            generator.engine = None
            generator.stale = True


def shared_adapter_sync(
    args: Any, model: torch.nn.Module, shared: SharedEngine, server: bool = False
) -> AdapterSync:
    """The push of the model's active adapter (a sweep's run) into the engine (or ``server``) it
    shares with the other runs: a merged push would put one run's adapter into every run's base,
    so it is refused."""
    name = getattr(model, "active_adapter", None)
    blocker = (
        adapter_sync_blocker(model)
        if name in shared.ids
        else f"adapter {name!r} is not one of {list(shared.ids)}"
    )
    if getattr(args, "vllm_lora_sync", None) is False or blocker is not None:
        raise ValueError(
            "runs that share one vLLM engine (a sweep) each need their LoRA adapter served on its own "
            f"(vllm_lora_sync=None or True), but {blocker or 'vllm_lora_sync=False asks for merged pushes'}; "
            "a merged push would put one run's adapter into the base every run samples from."
        )
    request_class = None
    if not server:
        from vllm.lora.request import LoRARequest as request_class
    folder = os.path.join(args.output_dir, "vllm-adapter")
    return AdapterSync(
        folder, request_class, name=name, adapter_id=shared.ids[name], peft_adapter=name, shared=shared
    )


def generate_together(calls: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[Samples]:
    """One engine call for several generators of one shared engine (a sweep's runs).

    Each generator's prompts are sampled with its own adapter (``lora_request`` per prompt) and
    its own sampling settings (``SamplingParams`` per prompt); vLLM batches them together. Each
    generator first gets its current adapter into the engine, as its own call would.

    Args:
        calls: ``(generator, prompt_ids [N, P], prompt_mask [N, P])`` for each request.

    Returns:
        Each request's completions, in order.

    Generators of one shared server send their requests at once, each naming its adapter, and the
    server batches them.

    Raises:
        ValueError: the generators do not share one engine, or one spans several processes
            (tensor parallelism) or sleeps between calls.
    """
    generators = [generator for generator, _, _ in calls]
    shared = generators[0].shared
    if shared is None or any(g.shared is not shared for g in generators):
        raise ValueError("generate_together serves generators of one SharedEngine; these do not share one.")
    if not hasattr(generators[0], "engine"):  # a server: the requests go at once, it batches them
        return _complete_together(calls)
    if any(g.gather_group is not None or g.sleep for g in generators):
        raise ValueError(
            "generate_together serves one-process engines that stay awake (no tensor parallelism, no sleep mode)."
        )
    prompts: list[dict[str, Any]] = []
    params: list[Any] = []
    loras: list[Any] = []
    for generator, prompt_ids, prompt_mask in calls:
        generator.ready()
        rows = unpadded_prompts(prompt_ids, prompt_mask)
        own_params = generator.make_params(generator.params)
        own_lora = generator.lora_request().get("lora_request")
        prompts += [{"prompt_token_ids": p} for p in rows]
        params += [own_params] * len(rows)
        loras += [own_lora] * len(rows)
    outputs = list(shared.engine.generate(prompts, params, use_tqdm=False, lora_request=loras))
    results, start = [], 0
    for generator, prompt_ids, _ in calls:
        rows = prompt_ids.shape[0]
        results.append(
            samples_from_outputs(outputs[start : start + rows], generator.pad_token_id, prompt_ids.device)
        )
        start += rows
    return results


def _complete_together(calls: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[Samples]:
    """A shared server's requests: each generator's adapter pushed first, then every completions
    request sent at once (one thread each), so the server's scheduler batches them."""
    from concurrent.futures import ThreadPoolExecutor

    for generator, _, _ in calls:
        generator.ready()
    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="posttrain-vllm-request") as pool:
        futures = [pool.submit(generator.complete, ids, mask) for generator, ids, mask in calls]
        return [future.result() for future in futures]
