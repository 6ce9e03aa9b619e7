"""The lean loop's decode step as one CUDA graph: captured at the first step, replayed per token.

On a GPU a small model's decode step is bound by kernel launches, not arithmetic: SmolLM2-135M
runs about 600 kernels per token, each a few microseconds of GPU work behind tens of microseconds
of Python and launch overhead (the H200 run in BENCHMARKS.md: 37 ms a step through the model's
forward). ``GraphedDecodeStep`` captures ``FusedDecoder.static_step`` (fixed shapes: attention
over the whole preallocated cache, masked) into a CUDA graph once per generation call and
replays it for every token; between replays only four small copies update its inputs (tokens,
positions, the write index and the attention mask of the new position).

It is the same arithmetic as ``FusedDecoder.step``, over the cache's capacity instead of the
filled length (masked positions add exact zeros after the softmax), so the logits equal the
unfused step's to float rounding.
"""

from __future__ import annotations

import math

import torch

from posttrain.generation.fused_step import FusedDecoder


def cuda_graph_blocker(fused: FusedDecoder | None, device: torch.device) -> str | None:
    """Why the decode step cannot be captured, or None when it can."""
    if fused is None:
        return "no fused decode step"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if fused.backend != "plain":
        return f"the {fused.backend!r} backend"
    if not fused.rope_is_static:
        return "rotary scaling that depends on the sequence length (dynamic, longrope)"
    return None


class GraphedDecodeStep:
    """A ``FusedDecoder``'s one-token steps replayed from a CUDA graph (same ``step`` signature).

    Args:
        fused: a plain-backend ``FusedDecoder`` on a CUDA model.
        capture: False runs ``static_step`` eagerly on the same fixed buffers at every call
            instead of replaying a graph (any device; for checking the fixed-shape arithmetic and
            the buffers' bookkeeping where there is no GPU).
    """

    def __init__(self, fused: FusedDecoder, capture: bool = True) -> None:
        self.fused = fused
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replays = 0

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor,
        cache_layers: list,
    ) -> torch.Tensor:
        """Logits [N, V] of one new position per row, written into the cache (``FusedDecoder.step``).

        The returned tensor is the graph's output buffer: the next call overwrites it.
        """
        length = key_mask.shape[1]
        if self.replays == 0:
            self._prepare(tokens, positions, key_mask, cache_layers)
        else:
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
            self.index.fill_(length - 1)
            self.bias[:, :length].masked_fill_(key_mask.bool(), 0.0)
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self._run()
        self.replays += 1
        for layer in cache_layers:
            layer._set_length(length)
        return self.logits

    def _run(self) -> torch.Tensor:
        return self.fused.static_step(
            self.tokens, self.positions, self.bias, self.index, self.buffers, self.table
        )

    def _prepare(
        self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor, cache_layers: list
    ) -> None:
        """The fixed input buffers from the first step's inputs; the graph too when capturing."""
        rows, length = key_mask.shape
        if any(layer.length != length - 1 for layer in cache_layers):
            raise ValueError(
                f"the cache holds {cache_layers[0].length} positions; a step over {length} keys needs "
                f"{length - 1}"
            )
        device = tokens.device
        self.buffers = [(layer._key_buffer, layer._value_buffer) for layer in cache_layers]
        for buffer in (b for pair in self.buffers for b in pair):
            # unwritten positions hold whatever the allocator left (NaN, inf): masked scores of
            # them and their zero weights must stay exact zeros, so they must be finite
            buffer[:, :, length - 1 :].zero_()
        capacity = self.buffers[0][0].shape[2]
        self.tokens, self.positions = tokens.clone(), positions.clone()
        self.index = torch.full((1,), length - 1, dtype=torch.long, device=device)
        self.bias = torch.full((rows, capacity), -math.inf, dtype=torch.float32, device=device)
        self.bias[:, :length].masked_fill_(key_mask.bool(), 0.0)
        self.table = self.fused.rotary_table(capacity, device)
        if not self.capture:
            return
        # warm-up outside the graph (library handles, lazy initialisations); it writes the same
        # keys and values at the same index as the replay will
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()
