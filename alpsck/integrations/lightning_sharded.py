"""Lightning's sharded checkpoints through alpsck: :class:`AlpsckModelParallelStrategy` (Lightning 2.6's
``ModelParallelStrategy``: FSDP2 and tensor parallelism, the model sharded in the user's ``configure_model``).

Sharded strategies bypass the ``CheckpointIO`` plugin: ``ModelParallelStrategy`` calls
``torch.distributed.checkpoint.save`` with DCP's ``FileSystemWriter`` for the model and optimizer shards, and
``torch.save`` (a pickle) for the rest of the checkpoint (loops, callbacks, epoch, schedulers). This subclass
changes those two calls and nothing else: every rank's shard goes through alpsck's DCP writer
(:class:`alpsck.dcp.AlpsckStorageWriter`: every chunk with its CRC32C, one atomic commit), and the rest of the
checkpoint goes into the same DCP checkpoint as values (alpsck keeps them as JSON, never as a pickle). Its load
reads both back through :class:`alpsck.dcp.AlpsckStorageReader`, every chunk CRC-checked, resharded by DCP::

    trainer = L.Trainer(strategy=AlpsckModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True)], ...)
    trainer.fit(model, data, ckpt_path="last")

Each checkpoint path Lightning names (``ckpts/last.ckpt``) is a directory, as with Lightning's own sharded
checkpoints. A path given to :meth:`AlpsckModelParallelStrategy.route` is an alpsck run directory instead: each save
is its step ``global_step`` (DCP's run-directory mode, with the writer options given there: ``keep_last``...), and a
load reads its newest valid step: the run directory of an ``alpsck submit`` job (:mod:`.lightning_job`).
``save_distributed_checkpoint=False`` (one full file on rank 0) goes through the ``CheckpointIO`` plugin
(:class:`.lightning.AlpsckCheckpointIO` takes it). A checkpoint of Lightning's own format still loads.
Not ``FSDPStrategy`` (FSDP1): torch 2.13's FSDP1 needs an accelerator, so nothing here could test it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from ..dcp import AlpsckStorageReader, AlpsckStorageWriter
from ..store.marker import is_marked

try:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:
    raise ImportError("alpsck.integrations.lightning_sharded needs Lightning 2.6 (pip install lightning)") from e

_REST = "lightning"  # the checkpoint's entries other than the model and the optimizers


class AlpsckModelParallelStrategy(ModelParallelStrategy):  # type: ignore[misc]
    """Lightning's ``ModelParallelStrategy`` whose sharded checkpoints are alpsck's (module docstring). Every
    argument is ModelParallelStrategy's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # run directory -> its writer's options, and what its saves record (route())
        self._routes: dict[Path, tuple[dict[str, Any], Callable[[], Mapping[str, float]] | None]] = {}

    def route(self, run_dir: str | Path, metrics: Callable[[], Mapping[str, float]] | None = None,
              **writer_options: Any) -> None:
        """Saves to ``run_dir`` are the steps of that alpsck run directory (``global_step``), written with
        ``writer_options`` (:class:`alpsck.dcp.AlpsckStorageWriter`'s); loads read its newest valid step. Every rank.
        ``metrics``: called at each save, what it returns recorded with the checkpoint (the writer's ``metrics=``)."""
        self._routes[Path(run_dir)] = (writer_options, metrics)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("AlpsckModelParallelStrategy.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(filepath))
        routed = self._routes.get(path)
        if routed is None:
            writer = AlpsckStorageWriter(path)
        else:
            options, metrics = routed
            writer = AlpsckStorageWriter(path, int(checkpoint.get("global_step", 0)),
                                         metrics=metrics() if metrics is not None else None, **options)
        state = {"state_dict": checkpoint.pop("state_dict"),
                 **{f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))},
                 _REST: checkpoint}
        dcp.save(state, storage_writer=writer)
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path not in self._routes and not is_marked(path):  # not alpsck's: Lightning's own formats
            return dict(super().load_checkpoint(checkpoint_path, weights_only))
        assert self.model is not None and self.lightning_module is not None
        reader = AlpsckStorageReader(path)  # one for the three loads: what failed in one is skipped in the next
        module_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(module_state, storage_reader=reader)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            for i, optim in enumerate(self.optimizers):
                key = f"optimizer_{i}"
                osd = {key: get_optimizer_state_dict(self.model, optim)}
                dcp.load(osd, storage_reader=reader)
                set_optimizer_state_dict(self.model, optim, optim_state_dict=osd[key],
                                         options=StateDictOptions(cpu_offload=True))
        rest: dict[str, Any] = _load_state_dict_from_keys(_REST, storage_reader=reader)[_REST]
        return rest
