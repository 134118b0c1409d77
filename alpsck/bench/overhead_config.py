"""What ``alpsck bench --overhead`` measures (:class:`OverheadConfig`) and its methods, apart from the
benchmark itself (:mod:`alpsck.bench.overhead`, which imports torch): the command line builds its
defaults from here when it registers ``bench``, on login nodes without torch too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("alpsck", "alpsck-overlap", "alpsck-crc-writers", "torch", "dcp-async")


@dataclass
class OverheadConfig:
    """What to measure. Model defaults: ~14 M parameters, ~170 MB of state with AdamW moments."""

    ks: list[int] = field(default_factory=lambda: [1, 5, 10, 25, 50])
    iters: int = 50
    warmup: int = 3
    rounds: int = 1  # the whole sweep this often, interleaved; each configuration reports its median round
    block: int = 20  # iterations per block at least (rounded up to a multiple of k)
    methods: list[str] = field(default_factory=lambda: ["alpsck", "torch"])
    in_flight: list[int] = field(default_factory=lambda: [2])
    threads: int | None = None  # alpsck writer threads; None: the Checkpointer's default
    dim: int = 512
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 256
    sequence_length: int = 64
    batch_size: int = 8
    seed: int = 0
    device: str = "cpu"
    torch_threads: int | None = None  # the training's intra-op threads; None: torch's default (every core)

    def validate(self) -> None:
        from ..errors import UsageError

        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise UsageError(f"unknown overhead method(s) {bad}; choose from {list(METHODS)}")
        if not self.ks or min(self.ks) < 1 or self.iters < 1 or self.warmup < 1 or min(self.in_flight) < 1 \
                or self.rounds < 1 or self.block < 1:
            raise UsageError("ks, iters, warmup, rounds, block and in-flight must be positive")
        if max(self.ks) > self.iters:
            raise UsageError(f"k {max(self.ks)} > --iters {self.iters}: every k needs at least one full interval")
        import torch

        if self.device.split(":")[0] not in ("cpu", "cuda") or (self.device.startswith("cuda")
                                                                 and not torch.cuda.is_available()):
            raise UsageError(f"--device {self.device}: use cpu, or cuda on a machine with a GPU")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise UsageError(f"--model-dim {self.dim} must split into --model-heads {self.n_heads} heads of even size")
