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

import importlib.util
from typing import TYPE_CHECKING, Any

from . import errors

__version__ = "0.1.0"

__all__ = ["Checkpointer", "RNGState", "Rollback", "TorchSaveCheckpointer", "errors", "gpu_numa_node",
           "loss_problem", "peek", "release_staging_memory", "restore_into", "__version__"]

# The public names that need torch, and the module each lives in. They are imported on first use
# (PEP 562), so that `import alpsck` and the command line (submit, status, cancel, doctor) work
# without torch, on a login node; without torch, touching one raises alpsck.errors.TorchMissingError
# (one line that says how to install it).
_LAZY = {
    "Checkpointer": "alpsck.checkpointer",
    "peek": "alpsck.checkpointer",
    "restore_into": "alpsck.checkpointer",
    "RNGState": "alpsck.rng",
    "Rollback": "alpsck.restore",
    "loss_problem": "alpsck.restore",
    "gpu_numa_node": "alpsck.staging",
    "release_staging_memory": "alpsck.staging",
    "TorchSaveCheckpointer": "alpsck.torch_save",
}

if TYPE_CHECKING:  # what type checkers and IDEs see: the names as plain imports
    from .checkpointer import Checkpointer, peek, restore_into
    from .restore import Rollback, loss_problem
    from .rng import RNGState
    from .staging import gpu_numa_node, release_staging_memory
    from .torch_save import TorchSaveCheckpointer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(errors.import_needing_torch(module, f"{__name__}.{name}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # A submodule (`alpsck.checkpointer.read_checkpoint` after `import alpsck`), as when this
        # package imported them all at once.
        value = errors.import_needing_torch(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
