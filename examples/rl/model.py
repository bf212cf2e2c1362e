"""A small decoder-only transformer (RMSNorm, rotary attention, MLP) in plain PyTorch.

Two ways through it: `forward` over whole sequences (training), and `prefill` + `decode`
against a preallocated KV cache (rollout). `decode` has static shapes and no host syncs,
so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int = 256
    layers: int = 4
    heads: int = 4
    max_seq: int = 32

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def kv_bytes_per_slot(self) -> int:
        """fp32 keys and values of one sequence of max_seq positions, every layer."""
        return self.layers * 2 * self.max_seq * self.dim * 4

    def parameter_count(self) -> int:
        per_layer = 4 * self.dim * self.dim + 8 * self.dim * self.dim + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(config: ModelConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.arange(config.max_seq, device=device, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos(), angles.sin()  # [max_seq, head_dim / 2]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., head_dim]; cos/sin broadcastable to [..., head_dim / 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.attn_norm = RMSNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        self.mlp_norm = RMSNorm(config.dim)
        self.up = nn.Linear(config.dim, 4 * config.dim, bias=False)
        self.down = nn.Linear(4 * config.dim, config.dim, bias=False)

    def _qkv(self, x: torch.Tensor):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.config.heads, self.config.head_dim).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, t, head_dim]

    def _finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, self.config.dim))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))

    def forward(self, x, cos, sin):
        """Causal attention over the whole sequence; returns (x, k, v) for caching."""
        q, k, v = self._qkv(x)
        t = x.shape[1]
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        return self._finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True)), k, v

    def decode(self, x, cos, sin, positions, k_cache, v_cache):
        """One token per row at `positions` [b]; writes its K/V into the cache rows [:b]."""
        q, k, v = self._qkv(x)  # [b, heads, 1, head_dim]
        c, s = cos[positions][:, None, None, :], sin[positions][:, None, None, :]
        q, k = apply_rotary(q, c, s), apply_rotary(k, c, s)
        b = x.shape[0]
        rows = torch.arange(b, device=x.device)
        k_cache[:b][rows, :, positions] = k[:, :, 0]
        v_cache[:b][rows, :, positions] = v[:, :, 0]
        keys, values = k_cache[:b], v_cache[:b]  # [b, heads, max_seq, head_dim]
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(self.config.head_dim)  # [b, heads, 1, max_seq]
        visible = torch.arange(self.config.max_seq, device=x.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        return self._finish(x, scores.softmax(-1) @ values)


class Policy(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def rotary(self, device):
        return rotary_tables(self.config, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [b, t, vocab] for every position of `tokens` [b, t]."""
        cos, sin = self.rotary(tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x, _, _ = block(x, cos, sin)
        return self.head(self.norm(x))

    def new_kv_cache(self, slots: int, device) -> torch.Tensor:
        """[layers, 2, slots, heads, max_seq, head_dim], zeroed: room for `slots` sequences."""
        c = self.config
        return torch.zeros(c.layers, 2, slots, c.heads, c.max_seq, c.head_dim, device=device)

    def prefill(self, tokens: torch.Tensor, kv_cache: torch.Tensor, cos, sin) -> torch.Tensor:
        """Runs the prompts [b, p], fills the cache rows [:b] at positions [:p]; last logits [b, vocab]."""
        b, p = tokens.shape
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, cos, sin)
            kv_cache[i, 0, :b, :, :p] = k
            kv_cache[i, 1, :b, :, :p] = v
        return self.head(self.norm(x[:, -1]))

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, cos, sin
                      ) -> torch.Tensor:
        """One step: `tokens` [b] at `positions` [b]; final hidden states [b, dim]. Graph-capturable.

        Serving engines capture this part and compute the logits outside the graph, so the
        graph's memory does not grow with the vocabulary."""
        x = self.embed(tokens)[:, None, :]
        for i, block in enumerate(self.blocks):
            x = block.decode(x, cos, sin, positions, kv_cache[i, 0], kv_cache[i, 1])
        return self.norm(x[:, 0])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, cos, sin) -> torch.Tensor:
        """One step: `tokens` [b] at `positions` [b]; logits [b, vocab]."""
        return self.head(self.decode_hidden(tokens, positions, kv_cache, cos, sin))
