"""The data and model the framework workers train (support/hf_trainer_worker.py, support/accelerate_worker.py):
24 samples of 8 features with a binary label, and a 2-layer MLP with dropout (so the RNG streams matter for a
bit-exact resume) whose forward returns ``{"logits", "loss"}``, as the transformers Trainer expects."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class Samples(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 24, d: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, d, generator=g)
        self.y = (self.x.sum(1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(d, h), nn.Dropout(0.3), nn.Linear(h, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.l2(self.drop(torch.relu(self.l1(x))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return out
