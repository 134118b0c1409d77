"""DCP's Hugging Face safetensors writer and reader on ``alpsck://`` (:mod:`.fsspec_fs`).

In torch 2.13 ``HuggingFaceStorageWriter`` and ``HuggingFaceStorageReader`` are ``FileSystemWriter`` and
``FileSystemReader`` over the local file system: they take a path, not a URL, and the reader opens each
``.safetensors`` file by its name (``safe_open``), past any file system object. These two subclasses change only
that: the writer's files go through ``alpsck://`` (written whole, each with its CRC32C beside it), and each rank's
reader checks every file it will read against its CRC32C, then reads it as the stock reader does (the files are
plain safetensors; the stock reader and ``safetensors.safe_open`` read them too)::

    dcp.save(model.state_dict(), storage_writer=AlpsckHuggingFaceStorageWriter("alpsck:///scratch/run/hf"))
    dcp.load(state, storage_reader=AlpsckHuggingFaceStorageReader("alpsck:///scratch/run/hf"))
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecAdapter  # DCP's own fsspec bridge
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import UsageError
from ..store import summed
from .fsspec_fs import local_path


def _url(path: str) -> str:
    return "alpsck://" + local_path(path)


class AlpsckHuggingFaceStorageWriter(HuggingFaceStorageWriter):  # type: ignore[misc]
    """``HuggingFaceStorageWriter`` whose files are written through ``alpsck://``; the same arguments, but
    ``enable_consolidation`` (its consolidated files are written past the writer's file system: for a model in
    Hugging Face's files, save into a run directory, with a Checkpointer or :class:`alpsck.dcp.AlpsckStorageWriter`,
    and run ``alpsck export --format hf``)."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        if kwargs.get("enable_consolidation"):
            raise UsageError("AlpsckHuggingFaceStorageWriter: enable_consolidation writes its files past alpsck:// "
                             "(unchecked); for a model in Hugging Face's files, save into a run directory (a Checkpointer, or "
                             "AlpsckStorageWriter) and run `alpsck export --format hf`")
        super().__init__(path=local_path(path), **kwargs)
        self._point_at(path)

    def _point_at(self, path: str) -> None:
        self.fs = _FsspecAdapter()  # type: ignore[assignment]  # both are FileSystemBase; torch annotates the local one
        self.path = self.fs.init_path(_url(path))

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._point_at(str(checkpoint_id))


class AlpsckHuggingFaceStorageReader(HuggingFaceStorageReader):  # type: ignore[misc]
    """``HuggingFaceStorageReader`` that checks every ``.safetensors`` file it reads against its CRC32C first: a
    damaged or unsummed file raises :class:`~alpsck.errors.CorruptCheckpointError` naming it."""

    def __init__(self, path: str, thread_count: int = 1) -> None:
        super().__init__(path=local_path(path), thread_count=thread_count)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each rank checks the files it reads, whole, before it reads them."""
        for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            summed.verify_file(name)
        return super().read_data(plan, planner)
