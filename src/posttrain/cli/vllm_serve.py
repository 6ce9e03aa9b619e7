"""``posttrain vllm-serve``: start the vLLM server that ``vllm_mode="server"`` trains against.

It runs ``vllm serve`` with what the trainer needs of it, the settings the spec gives for server
mode: the weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``), NCCL weight transfer
(``--weight-transfer-config '{"backend": "nccl"}'``), log-probs after temperature and filters
(``--logprobs-mode processed_logprobs``) and no cap on returned log-probs
(``--max-logprobs -1``). Flags it does not know go to ``vllm serve`` unchanged. Run it on other
GPUs than the trainer's (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import sys

from posttrain.cli.options import CLIError

#: What server mode needs of ``vllm serve``, whatever the user passes.
REQUIRED_FLAGS: tuple[str, ...] = (
    "--weight-transfer-config",
    '{"backend": "nccl"}',
    "--logprobs-mode",
    "processed_logprobs",
    "--max-logprobs",
    "-1",
)


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
        "--gpu_memory_utilization", type=float, default=0.9, help="fraction of each GPU's memory"
    )
    parser.add_argument(
        "--max_model_len", type=int, default=None, help="context window (prompt + completion)"
    )
    parser.add_argument("--dtype", default="auto", help="weights' dtype in the engine")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow the model's own code")
    parser.add_argument(
        "--dry_run", action="store_true", help="print the command and its environment, do not run it"
    )
    return parser


def serve_command(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line and the environment variables it needs.

    Raises:
        CLIError: a bad value (a GPU memory fraction outside (0, 1], a size below 1).
    """
    args, passthrough = _parser().parse_known_args(argv)
    if not 0 < args.gpu_memory_utilization <= 1:
        raise CLIError(
            f"--gpu_memory_utilization={args.gpu_memory_utilization} must be a fraction in (0, 1], such as 0.9."
        )
    for name in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name}={getattr(args, name)} must be 1 or more.")
    command = ["vllm", "serve", args.model, "--host", args.host, "--port", str(args.port)]
    command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    command += ["--data-parallel-size", str(args.data_parallel_size)]
    command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--dtype", args.dtype]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.trust_remote_code:
        command.append("--trust-remote-code")
    command += [*REQUIRED_FLAGS, *passthrough]
    return command, {"VLLM_SERVER_DEV_MODE": "1"}


def vllm_serve(argv: list[str]) -> None:
    """Start a vLLM server for vllm_mode="server" (vllm serve with the weight-transfer routes).

    Raises:
        CLIError: vLLM is not installed (names the extra), or a bad flag value.
    """
    command, env = serve_command(argv)
    if "--dry_run" in argv:
        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(command))
        return
    executable = shutil.which("vllm")
    if executable is None or importlib.util.find_spec("vllm") is None:
        raise CLIError(
            'vLLM is not installed: pip install "posttrain[vllm]" on a machine with a CUDA GPU, then run this '
            "command again (or use vllm_mode='colocate', which runs vLLM inside the training processes)."
        )
    sys.stdout.flush()
    os.execvpe(executable, command, {**os.environ, **env})
