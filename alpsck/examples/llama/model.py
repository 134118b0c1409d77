"""A Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied output.

``ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
ffn_dim_multiplier=1.3, multiple_of=1024)`` is Llama-3-8B (8,030,261,248 parameters); build it
under ``torch.device("meta")`` to inspect it without memory. The rotary tables are computed in
float32 in every forward (they are not buffers), so casting the model to bf16 does not round them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (no grouping)
    vocab_size: int = 256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        if self.dim % self.n_heads or self.head_dim % 2:
            raise ValueError(f"dim {self.dim} must split into n_heads {self.n_heads} heads of even size")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.kv_heads}")


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama-3's SwiGLU hidden size: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim / 2``, float32."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def apply_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (batch, seq, heads, head_dim) by position * frequency."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = rope_frequencies(head_dim, theta, x.device)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    pairs = x.float().reshape(*x.shape[:-1], head_dim // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.theta = args.rope_theta
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, self.theta), apply_rope(k, self.theta)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (batch, seq) → logits (batch, seq, vocab)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2*n_layers)."""
        std = self.args.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.args.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))
