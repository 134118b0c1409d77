"""Data-loader positions that restore in O(1).

:class:`ResumableSampler` yields a pseudo-random permutation of ``range(n)`` per epoch that is a
pure function of ``(seed, epoch)``, computed one index at a time (a keyed Feistel network with
cycle walking), so jumping to sample 10**9 of an epoch costs nothing: no permutation array, no
replay. :class:`ResumableLoader` wraps a ``DataLoader`` over that sampler and counts the samples
the *training loop* consumed (not the ones workers prefetched), so its ``state_dict()`` taken
between steps resumes exactly at the next unconsumed batch.

If ``torchdata`` is installed, ``torchdata.stateful_dataloader.StatefulDataLoader`` can be put in
the checkpointed state as-is (it has ``state_dict``/``load_state_dict``); it restores by
fast-forwarding its sampler, which is O(position) for the default samplers.

Threading: neither class is thread-safe; use each from the training thread. Call
``load_state_dict`` before starting an iteration, not during one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from alpsck.errors import ConfigError

_MASK64 = (1 << 64) - 1
_ROUNDS = 6
_WORKER_SEED_SALT = 0x5EED  # keeps the workers' base seed apart from the permutation key


def mix64(x: int) -> int:
    """The splitmix64 finalizer: a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (e.g. ``(seed, step, rank)``)."""
    h = 0x6A09E667F3BCC908
    for p in parts:
        h = mix64(h ^ (int(p) & _MASK64))
    return h & ((1 << 63) - 1)


class FeistelPermutation:
    """A keyed bijection of ``range(n)`` evaluated per index in O(1) expected time."""

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError("n must be >= 0")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        self._keys = [derive_seed(key, r) for r in range(_ROUNDS)]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range({self.n})")
        x = i
        while True:  # cycle walking: the domain is < 4n, so this loops < 4 times on average
            left, right = x >> self._half, x & self._mask
            for k in self._keys:
                left, right = right, left ^ (mix64(right ^ k) & self._mask)
            x = (left << self._half) | right
            if x < self.n:
                return x


class ResumableSampler(Sampler[int]):
    """Deterministic per-epoch permutation with an O(1) ``state_dict``/``load_state_dict``.

    ``len()`` is the number of indices per epoch for this rank (``n // num_replicas`` when
    ``num_replicas > 1``: the tail is dropped so all ranks see equally many). Iterating yields the
    current epoch from the current ``position``; exhausting it moves to the next epoch.
    ``state_dict()`` is ``{"epoch", "position", "seed"}``; ``position`` counts indices this sampler
    has *yielded* — a ``DataLoader`` runs ahead of the training loop, which is why
    :class:`ResumableLoader` keeps its own consumed count.
    """

    def __init__(self, data_source: Sized | int, *, seed: int = 0, shuffle: bool = True,
                 num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__()
        n = data_source if isinstance(data_source, int) else len(data_source)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} / num_replicas {num_replicas} is invalid")
        self.n, self.seed, self.shuffle = n, int(seed), shuffle
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0
        self.position = 0
        self._perm: FeistelPermutation | None = None
        self._perm_for: tuple[int, int] = (-1, -1)

    def __len__(self) -> int:
        return self.n // self.num_replicas if self.num_replicas > 1 else self.n

    def index(self, epoch: int, position: int) -> int:
        """The dataset index at ``position`` of ``epoch`` for this rank, in O(1)."""
        j = position * self.num_replicas + self.rank
        if not self.shuffle:
            return j
        if self._perm is None or self._perm_for != (self.seed, epoch):
            self._perm = FeistelPermutation(self.n, derive_seed(self.seed, epoch))
            self._perm_for = (self.seed, epoch)
        return self._perm(j)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning on the next iteration."""
        self.epoch, self.position = int(epoch), 0

    def __iter__(self) -> Iterator[int]:
        return self._iterate(self.epoch, self.position)

    def _iterate(self, epoch: int, start: int) -> Iterator[int]:
        n = len(self)
        for pos in range(start, n):
            self.position = pos + 1
            yield self.index(epoch, pos)
        if self.epoch == epoch:
            self.epoch, self.position = epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch, position, seed = (int(state[k]) for k in ("epoch", "position", "seed"))
        if epoch < 0 or not 0 <= position <= len(self):
            raise ValueError(f"sampler state epoch={epoch} position={position} is out of range "
                             f"(epoch length {len(self)})")
        self.epoch, self.position, self.seed = epoch, position, seed


class ResumableLoader:
    """A ``DataLoader`` over a :class:`ResumableSampler` that counts consumed samples.

    ``state_dict()`` = ``{"epoch", "position", "seed"}`` where ``position`` is the number of
    samples of ``epoch`` handed to the caller so far (prefetched batches are not counted). Taking
    the state after consuming batch *k* and loading it into a fresh loader makes the next
    iteration start at batch *k + 1*. After the last batch of an epoch the state already points
    at the next epoch. Loop as ``while loader.epoch < n_epochs: for batch in loader: ...`` so a
    resumed run does the same number of epochs. Extra keyword arguments go to ``DataLoader``.
    Workers' base seeds come from ``(seed, epoch)``, not from the global torch RNG, so a resumed
    run leaves that RNG exactly where the uninterrupted run has it (pass ``generator=`` to
    override; its state is then not checkpointed).
    """

    def __init__(self, dataset: Dataset[Any], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, num_replicas: int = 1, rank: int = 0,
                 **dataloader_kwargs: Any) -> None:
        for bad in ("sampler", "batch_sampler", "shuffle"):
            if bad in dataloader_kwargs:
                raise ConfigError(f"ResumableLoader: {bad!r} cannot be given; it owns the sampler")
        if batch_size < 1:
            raise ConfigError(f"ResumableLoader: batch_size must be >= 1, got {batch_size}")
        self.sampler = ResumableSampler(dataset, seed=seed, shuffle=shuffle,  # type: ignore[arg-type]
                                        num_replicas=num_replicas, rank=rank)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 drop_last=drop_last, **dataloader_kwargs)
        # Each DataLoader iterator draws its workers' base seed from loader.generator, or else
        # from the global torch RNG. The global draw happens once more on a resumed run (after
        # RNGState was restored), leaving that RNG a draw ahead of the uninterrupted run: dropout
        # and every torch.rand after it differ. So the draw comes from a generator of our own,
        # seeded from (seed, epoch), unless the caller passed one.
        self._own_generator = "generator" not in dataloader_kwargs
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per full epoch."""
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _end(self, position: int) -> bool:
        remaining = len(self.sampler) - position
        return remaining == 0 or (self.drop_last and remaining < self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.epoch, self.position
        self.sampler.epoch, self.sampler.position = epoch, start
        if self._own_generator:
            self.loader.generator = torch.Generator().manual_seed(derive_seed(self.sampler.seed, epoch, _WORKER_SEED_SALT))
        if not self._end(start):
            for batch in self.loader:
                self.position = min(self.position + self.batch_size, len(self.sampler))
                if self._end(self.position):
                    self.epoch, self.position = epoch + 1, 0
                yield batch
        if self.epoch == epoch:
            self.epoch, self.position = epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.sampler.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        epoch, position, seed = (int(state[k]) for k in ("epoch", "position", "seed"))
        if epoch < 0 or not 0 <= position <= len(self.sampler):
            raise ValueError(f"loader state epoch={epoch} position={position} is out of range")
        self.epoch, self.position, self.sampler.seed = epoch, position, seed
