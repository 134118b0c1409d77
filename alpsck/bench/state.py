"""A transformer-like training state of a chosen size: bf16 weights, fp32 Adam moments, norms."""

from __future__ import annotations

import torch


def transformer_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors whose sizes add up to about ``total_bytes``, shaped like a Llama layer stack.

    Per layer: attention and FFN matrices in bf16 (the model), two fp32 moments per matrix (the
    optimizer), and small fp32 norm vectors. The dimension is chosen so there are ~16 layers.
    """
    g = torch.Generator().manual_seed(seed)
    # bytes per layer ~ 12*d^2 params * (2 bf16 + 8 fp32 moments) = 120 d^2
    per_layer = max(total_bytes // 16, 1 << 16)
    d = max(64, int((per_layer / 120) ** 0.5) // 64 * 64)
    out: dict[str, torch.Tensor] = {}
    done = 0
    layer = 0
    shapes = {"wq": (d, d), "wk": (d // 4, d), "wv": (d // 4, d), "wo": (d, d), "w1": (4 * d, d), "w2": (d, 4 * d),
              "w3": (4 * d, d)}
    while done < total_bytes:
        for name, shape in shapes.items():
            w = torch.randn(shape, generator=g).to(torch.bfloat16)
            out[f"model/layers.{layer}.{name}"] = w
            for m in ("exp_avg", "exp_avg_sq"):
                out[f"optim/layers.{layer}.{name}.{m}"] = torch.randn(shape, generator=g)
            done += w.numel() * 10
        out[f"model/layers.{layer}.norm"] = torch.ones(d)
        done += d * 4
        layer += 1
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
