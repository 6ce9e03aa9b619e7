"""vLLM's server mode (``vllm_mode="server"``): a ``posttrain vllm-serve`` server's completions
endpoint and the weight pushes to it.

:class:`VLLMServerGenerator` samples through :class:`VLLMServerClient`; the weights go over NCCL
through vLLM's trainer-side weight-transfer engine (:func:`nccl_weight_sync`) from a trainer with
a CUDA GPU, else as a safetensors file in a folder the server reloads (:class:`FolderWeightSync`).
``generation/vllm_backend.py`` picks the push (``weight_sync_backend``) and builds the generator.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.generation.base import EnginePrompts, Samples, check_expansion
from posttrain.generation.vllm_common import (
    merged_adapters,
    samples_from_outputs,
    unpadded_prompts,
)
from posttrain.generation.vllm_lora import AdapterSync, adapters_enabled, base_weight_items


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
        if not body:
            return None
        try:
            return json.loads(body)
        except ValueError:  # a plain-text answer (/v1/load_lora_adapter's "Success: ...")
            return body.decode(errors="replace")

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

    def reset_encoder_cache(self) -> None:
        """Drop the server's cached image encodings (``POST /reset_encoder_cache``, a dev-mode
        route): after a push they hold the old vision tower's outputs. A server without the route
        (older vLLM) is left as it is."""
        try:
            self._request("reset_encoder_cache", {}, timeout=self.request_timeout)
        except urllib.error.HTTPError as error:
            if error.code != 404:
                raise

    def load_adapter(self, name: str, folder: str) -> None:
        """Have the server load (or reload in place) the LoRA adapter saved in ``folder`` as ``name``
        (``POST /v1/load_lora_adapter``, open with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which
        ``posttrain vllm-serve`` sets; the server must be started with ``--enable-lora``)."""
        payload = {"lora_name": name, "lora_path": folder, "load_inplace": True}
        try:
            self._request("v1/load_lora_adapter", payload, timeout=self.request_timeout)
        except urllib.error.HTTPError as error:
            if error.code in (400, 404):
                detail = error.read().decode(errors="replace")[:300]
                raise RuntimeError(
                    f"the vLLM server at {self.base_url} did not load the LoRA adapter ({error.code}: {detail}). "
                    "vllm_lora_sync=True needs a server started with --enable-lora --max-lora-rank R (R at least "
                    "the adapter's rank) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (posttrain vllm-serve sets it)."
                ) from error
            raise

    def request_completions(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``choices`` of ``POST /v1/completions`` with ``payload`` as it is."""
        return self._request("v1/completions", payload, timeout=self.request_timeout)["choices"]

    def complete(
        self, prompts: list[list[int]], params: dict[str, Any], model: str | None = None
    ) -> list[Any]:
        """One completion per prompt (token ids in, token ids and log-probs out), in prompt order.

        ``model``: a LoRA adapter the server loaded (``load_adapter``); None for its base model."""
        payload = {k: v for k, v in params.items() if k not in ("detokenize", "n")}
        payload.update(model=model or self.model(), prompt=prompts, n=1, return_token_ids=True)
        choices = self._request("v1/completions", payload, timeout=self.request_timeout)["choices"]
        if len(choices) != len(prompts):
            raise RuntimeError(
                f"the vLLM server at {self.base_url} returned {len(choices)} completions for {len(prompts)} prompts."
            )
        return [_ServerOutput(c) for c in sorted(choices, key=lambda c: c["index"])]

    def complete_with_images(
        self, prompts: EnginePrompts, params: dict[str, Any], model: str | None = None
    ) -> list[Any]:
        """One completion per row with images: its tokens (one placeholder per image) and its images
        go to the token-in, token-out route ``POST /inference/v1/generate`` (images as PNG data URLs
        in ``content_parts``; the server's processor expands the placeholders), one request per row,
        sent together. Each output carries the prompt tokens the server expanded.

        Raises:
            RuntimeError: the route is closed or missing (names ``--enable-scale-out`` and vLLM 0.32).
        """
        sampling = {k: v for k, v in params.items() if k != "n"}

        def one(ids: list[int], images: list[Any]) -> Any:
            payload = {
                "token_ids": ids, "sampling_params": sampling, "model": model or self.model(),
                "return_token_ids": True, "content_parts": [{"type": "image_url", "url": _data_url(im)} for im in images],
            }  # fmt: skip
            if not images:
                del payload["content_parts"]
            try:
                return _GenerateOutput(
                    self._request("inference/v1/generate", payload, timeout=self.request_timeout)
                )
            except urllib.error.HTTPError as error:
                if error.code in (403, 404):
                    raise RuntimeError(
                        f"the vLLM server at {self.base_url} does not serve POST /inference/v1/generate ({error.code}), "
                        "through which prompts with images go: start it with --enable-scale-out (posttrain vllm-serve "
                        "does, on vLLM 0.32 or newer)."
                    ) from error
                raise

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, max(1, len(prompts.ids)))) as pool:
            return list(pool.map(one, prompts.ids, prompts.images))


def _data_url(image: Any) -> str:
    """A PIL image as a PNG data URL (lossless: the server's processor reads the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class _Logprob:
    def __init__(self, value: float) -> None:
        self.logprob = value


class _GenerateOutput:
    """A ``/inference/v1/generate`` answer read like vLLM's ``RequestOutput`` (its completion's
    tokens and log-probs, and the prompt tokens the server expanded)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        choice = answer["choices"][0]
        content = (choice.get("logprobs") or {}).get("content")
        values = None if content is None else [entry["logprob"] for entry in content]
        self.outputs = [
            _ServerCompletion({**choice, "logprobs": None if values is None else {"token_logprobs": values}})
        ]
        self.prompt_token_ids = list(answer.get("prompt_token_ids") or [])


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
    without it leaves the server's head at its old values, with only a warning in its log.
    4-bit (bitsandbytes) weights go dequantized (``vllm_lora.base_weight_items``): the values the
    trainer multiplies by, which a QLoRA policy's one base push sends (``vllm_lora_sync``)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in base_weight_items(model):
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


def nccl_weight_sync(
    client: VLLMServerClient, model: torch.nn.Module, host: str, port: int, rank: int
) -> Any:
    """vLLM's trainer-side NCCL weight-transfer engine, joined with the server's workers.

    The group is this trainer's sender (rank 0) plus the server's workers
    (``1 + GET /get_world_size``), rendezvous at ``host:port`` (``vllm_group_port``); each
    ``send_weights()`` broadcasts the weights under their checkpoint names
    (:func:`weight_items`, so a PEFT model sends its merged base weights; 4-bit weights
    dequantized, as ``vllm_lora.base_weight_items`` gives them).
    """
    import inspect
    from functools import cached_property

    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    def described() -> list[Any]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in base_weight_items(model)]

    # vLLM 0.32 declares `metadata()` a method and iterates the source itself; 0.34 reads a
    # `metadata` property and calls `iter_full()`. The class answers both.
    declared = inspect.getattr_static(WeightSource, "metadata", None)
    as_property = isinstance(declared, (property, cached_property))

    class CheckpointNamedSource(WeightSource):
        """The model's weights under their checkpoint names, owned by every trainer rank."""

        metadata = cached_property(lambda self: described()) if as_property else (lambda self: described())

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from base_weight_items(model)

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from base_weight_items(model)

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
        adapter: ``vllm_lora_sync``: the base goes once through ``make_sync``'s transfer, then only
            the adapter, saved to this ``vllm_lora.AdapterSync``'s folder and loaded by the server
            under its name.
        shared: the server is shared with other generators, each its own adapter (a sweep's runs:
            ``vllm_lora.SharedEngine``, whose base is pushed once for all).
    """

    #: Takes rows with images as ``EnginePrompts``: the server runs the model's processor on them.
    runs_processor = True

    def __init__(
        self,
        client: VLLMServerClient,
        params: dict[str, Any],
        pad_token_id: int,
        make_sync: Callable[[torch.nn.Module], Any],
        get_model: Callable[[], torch.nn.Module],
        adapter: AdapterSync | None = None,
        shared: Any = None,
    ) -> None:
        self.client = client
        self.adapter = adapter
        self.shared = shared
        self.params = params
        self.pad_token_id = pad_token_id
        self.make_sync = make_sync
        self.get_model = get_model
        self.sync: Any = None
        self.stale = True
        self.pushes = 0
        #: Whether prompts with images were sent: their encodings are dropped at every push.
        self.serves_images = False

    def weights_changed(self) -> None:
        """The optimizer stepped: send the trainer's weights before the next generation."""
        self.stale = True

    def push_weights(self) -> None:
        """Send the current weights to the server's workers (vLLM's four-phase update); with
        ``adapter``, the base weights once (the adapter left out) and then the adapter alone."""
        model = self.get_model()
        if self.adapter is not None:
            if not self.adapter.base_loaded:
                with model.disable_adapter():  # the sync sends the base, the adapter's weights left out
                    self._sync(model).send_weights()
                self.adapter.base_loaded = True
            self.adapter.save(model)
            self.client.load_adapter(self.adapter.name, os.path.abspath(self.adapter.folder))
        else:
            with merged_adapters(model):
                self._sync(model).send_weights()
        if self.serves_images:
            self.client.reset_encoder_cache()
        self.stale = False
        self.pushes += 1

    def _sync(self, model: torch.nn.Module) -> Any:
        if self.sync is None:
            self.sync = self.make_sync(model)
        return self.sync

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, engine_prompts: EnginePrompts | None = None
    ) -> Samples:
        """Args: prompt_ids [N, P], prompt_mask [N, P] (left-padded); ``engine_prompts``: the rows
        with their images (``VLLMServerClient.complete_with_images``), the server's expansion checked
        against ``prompt_ids``. Returns one completion per row."""
        if engine_prompts is None:
            self.ready()
            return self.complete(prompt_ids, prompt_mask)
        self.serves_images = True
        self.ready()
        outputs = self.client.complete_with_images(engine_prompts, self.params, model=self._served())
        check_expansion(
            [o.prompt_token_ids for o in outputs],
            unpadded_prompts(prompt_ids, prompt_mask),
            "The vLLM server",
        )
        return samples_from_outputs(outputs, self.pad_token_id, prompt_ids.device)

    def _served(self) -> str | None:
        """The model to ask for: this generator's adapter while the model's adapters are on, else the base."""
        if self.adapter is not None and adapters_enabled(self.get_model()):
            return self.adapter.name
        return None

    def ready(self) -> None:
        """Give the server the trainer's current weights (or adapter) if they changed."""
        if self.stale:
            self.push_weights()

    def complete(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """The server's completions of the prompts, from the weights it holds (with this generator's
        adapter while the model's adapters are on)."""
        outputs = self.client.complete(
            unpadded_prompts(prompt_ids, prompt_mask), self.params, model=self._served()
        )
        return samples_from_outputs(outputs, self.pad_token_id, prompt_ids.device)
