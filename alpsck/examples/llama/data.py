"""Batches that are pure functions of ``(seed, index, rank)``, so the data position restores in O(1).

:class:`SyntheticBatches` draws arithmetic sequences mod ``vocab_size`` with a little noise (a
model can learn them, so losses fall); :class:`TextBatches` draws random windows of a local text
file tokenized byte by byte (ids 0..255, plus :data:`BOS` / :data:`EOS`). Both keep one counter,
``position`` = index of the next batch, which is their whole checkpointed state
(``state_dict() == {"seed", "position"}``). Not thread-safe; call from the training thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from alpsck.data import derive_seed
from alpsck.errors import ConfigError

BOS, EOS = 256, 257
TEXT_VOCAB = 258


class _Batches:
    """Shared bookkeeping: ``next()`` returns batch ``position`` and advances it."""

    def __init__(self, batch_size: int, seq_len: int, seed: int, rank: int) -> None:
        self.batch_size, self.seq_len, self.seed, self.rank = batch_size, seq_len, seed, rank
        self.position = 0

    def generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, index, self.rank))

    def tokens(self, index: int) -> torch.Tensor:
        """(batch_size, seq_len + 1) int64 tokens of batch ``index``."""
        raise NotImplementedError

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of batch ``index``, each (batch_size, seq_len) int64 on CPU."""
        t = self.tokens(index)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        seed, position = int(state["seed"]), int(state["position"])
        if position < 0:
            raise ValueError(f"data position {position} < 0")
        self.seed, self.position = seed, position


class SyntheticBatches(_Batches):
    """Rows ``(start + stride * t) % vocab`` with stride in 1..4 and 5% random tokens."""

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int, rank: int = 0) -> None:
        super().__init__(batch_size, seq_len, seed, rank)
        self.vocab_size = vocab_size

    def tokens(self, index: int) -> torch.Tensor:
        g = self.generator(index)
        shape = (self.batch_size, 1)
        start = torch.randint(0, self.vocab_size, shape, generator=g)
        stride = torch.randint(1, 5, shape, generator=g)
        t = torch.arange(self.seq_len + 1).unsqueeze(0)
        seq = (start + stride * t) % self.vocab_size
        noise = torch.randint(0, self.vocab_size, seq.shape, generator=g)
        mask = torch.rand(seq.shape, generator=g) < 0.05
        return torch.where(mask, noise, seq)


def read_corpus(path: str | Path, column: str = "text") -> torch.Tensor:
    """Byte tokens (int16) of a .txt file, or of a .parquet file's ``column`` (documents joined by EOS)."""
    p = Path(path)
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"data_file: reading {p} needs pyarrow (pip install pyarrow)") from None
        table = pq.read_table(p, columns=[column])
        docs = [str(x).encode() for x in table.column(column).to_pylist() if x is not None]
        ids: list[int] = []
        for d in docs:
            ids.extend(d)
            ids.append(EOS)
        return torch.tensor(ids, dtype=torch.int16)
    data = p.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16)


class TextBatches(_Batches):
    """Random windows of ``seq_len + 1`` tokens: BOS followed by the corpus, wrapping around."""

    def __init__(self, corpus: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int = 0) -> None:
        super().__init__(batch_size, seq_len, seed, rank)
        if corpus.numel() == 0:
            raise ConfigError("data_file: the file holds no tokens")
        self.corpus = torch.cat([torch.tensor([BOS], dtype=torch.int16), corpus.to(torch.int16)])

    def tokens(self, index: int) -> torch.Tensor:
        g = self.generator(index)
        n = self.corpus.numel()
        starts = torch.randint(0, n, (self.batch_size, 1), generator=g)
        idx = (starts + torch.arange(self.seq_len + 1).unsqueeze(0)) % n
        return self.corpus[idx].long()
