"""The rollout engine: its own copy of the weights, a preallocated KV cache, a prefill
step, and the decode step captured as CUDA graphs for batch sizes 1, 2, 4, ... (padded to
the nearest captured size, as serving engines do). As in vLLM, the graphs end at the final
hidden state and the logits are computed outside them, and the KV cache is sized like a
serving engine's: room for `kv_slots` sequences, however many a step uses.

With a saver, the weights, the KV cache and the graph pool live in the regions "weights",
"kv_cache" and "cuda_graph", so the whole engine can be paused while the trainer runs.
The small static tensors the graphs read (rotary tables, step inputs) stay outside the
regions: they must keep their content across a pause.
"""

from __future__ import annotations

import contextlib

import torch

from .model import ModelConfig, Policy
from .task import digit_logits


class RolloutEngine:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], batch_sizes: list[int],
                 prompt_length: int, completion_length: int, device: torch.device, saver=None,
                 kv_slots: int | None = None):
        self.saver = saver
        self.device = device
        self.prompt_length = prompt_length
        self.completion_length = completion_length
        self.batch_sizes = sorted(batch_sizes)
        with self._region("weights"), torch.device(device):
            self.model = Policy(config).requires_grad_(False).eval()
        self.load_weights(weights)
        with self._region("kv_cache"):
            self.kv_cache = self.model.new_kv_cache(max(kv_slots or 0, self.batch_sizes[-1]), device)
        self.cos, self.sin = self.model.rotary(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.static_tokens = torch.zeros(self.batch_sizes[-1], dtype=torch.long, device=device)
        self.static_positions = torch.zeros(self.batch_sizes[-1], dtype=torch.long, device=device)
        self.static_hidden: dict[int, torch.Tensor] = {}
        if device.type == "cuda":
            self._capture()

    def _region(self, tag: str):
        return self.saver.region(tag) if self.saver is not None else contextlib.nullcontext()

    def _decode_eager(self, b: int) -> torch.Tensor:
        return self.model.decode_hidden(self.static_tokens[:b], self.static_positions[:b], self.kv_cache,
                                        self.cos, self.sin)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in self.batch_sizes:
                self._decode_eager(b)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        shared_pool = None if self.saver is not None else torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):  # largest first: smaller ones reuse its memory
            graph = torch.cuda.CUDAGraph()
            if self.saver is not None:
                capture = self.saver.cuda_graph(graph, tag="cuda_graph")
            else:
                capture = torch.cuda.graph(graph, pool=shared_pool)
            with capture:
                self.static_hidden[b] = self._decode_eager(b)
            self.graphs[b] = graph

    def padded_size(self, n: int) -> int:
        for b in self.batch_sizes:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences exceed the largest captured batch size {self.batch_sizes[-1]}")

    def _step(self, b: int, tokens: torch.Tensor, position: int) -> torch.Tensor:
        self.static_tokens[:b].copy_(tokens)
        self.static_positions[:b].fill_(position)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.model.head(self.static_hidden[b])
        return self.model.head(self._decode_eager(b))

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy in place, so the addresses the graphs recorded stay valid. Returns once the
        copies are done, so host sources may be freed right after."""
        for name, parameter in self.model.named_parameters():
            parameter.copy_(weights[name], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
        """Completions [n, completion_length] of digits for prompts [n, prompt_length]."""
        n = prompts.shape[0]
        b = self.padded_size(n)
        padded = torch.cat([prompts, prompts[:1].expand(b - n, -1)]) if b > n else prompts
        # Attention weighs every cached position (the unwritten ones by zero), and memory
        # resumed after a pause holds anything, NaN included: the rows in use start clean.
        self.kv_cache[:, :, :b].zero_()
        logits = self.model.prefill(padded, self.kv_cache, self.cos, self.sin)
        tokens = [self._sample(logits, temperature, generator)]
        for t in range(self.completion_length - 1):
            logits = self._step(b, tokens[-1], self.prompt_length + t)
            tokens.append(self._sample(logits, temperature, generator))
        return torch.stack(tokens, dim=1)[:n]

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
        probs = torch.softmax(digit_logits(logits.float()) / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    @torch.no_grad()
    def graph_vs_eager(self, prompts: torch.Tensor) -> float:
        """Largest |graph - eager| over one decode step's output (the final hidden states)
        for the largest batch."""
        b = self.batch_sizes[-1]
        padded = torch.cat([prompts, prompts[:1].expand(b - prompts.shape[0], -1)])[:b]
        self.kv_cache[:, :, :b].zero_()
        first = self.model.prefill(padded, self.kv_cache, self.cos, self.sin).argmax(-1)
        self.static_tokens[:b].copy_(first)
        self.static_positions[:b].fill_(self.prompt_length)
        self.graphs[b].replay()
        graph_hidden = self.static_hidden[b].clone()
        eager_hidden = self._decode_eager(b)
        return float((graph_hidden - eager_hidden).abs().max())
