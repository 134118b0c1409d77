"""alpsck: crash-safe persistent concurrent checkpointing and requeue for PyTorch on SLURM.

Quick use::

    import alpsck
    with alpsck.Checkpointer("runs/exp1", max_in_flight=2) as ckpt:
        state = {"model": model, "optim": opt, "sched": sched, "rng": alpsck.RNGState()}
        start = (ckpt.restore(state) or 0) + 1
        for step in range(start, steps + 1):
            train_step()
            if step % 50 == 0:
                ckpt.save(step, state)       # returns after the snapshot; persists in background

``alpsck.peek(run_dir)`` reads a checkpoint's non-tensor state without a model (tensors described
by :class:`alpsck.tree.TensorRef`), e.g. ``alpsck.peek("runs/x")["model_args"]``.
"""

from __future__ import annotations

from . import errors
from .bench.torch_save import TorchSaveCheckpointer
from .checkpointer import Checkpointer, peek, restore_into
from .numa import gpu_numa_node
from .restore import Rollback, loss_problem
from .rng import RNGState

__version__ = "0.1.0"

__all__ = ["Checkpointer", "RNGState", "Rollback", "TorchSaveCheckpointer", "errors", "gpu_numa_node",
           "loss_problem", "peek", "restore_into", "__version__"]
