"""The two torch.distributed.checkpoint storage backends the DCP contract tests run side by side
(DCP's FileSystemWriter/Reader, the reference, and alpsck's), and a writer or reader made to fail at one stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.futures import Future

from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter


@dataclass
class Backend:
    name: str
    writer: Callable[..., Any]  # (path, **options) -> StorageWriter
    reader: Callable[..., Any]  # (path) -> StorageReader


BACKENDS = {
    "fs": Backend("fs", lambda path, threads=1, overwrite=True: FileSystemWriter(path, thread_count=threads,
                                                                                overwrite=overwrite),
                  lambda path: FileSystemReader(path)),
    "alpsck": Backend("alpsck", lambda path, threads=1, overwrite=True: AlpsckStorageWriter(path, threads=threads,
                                                                                           overwrite=overwrite),
                      lambda path: AlpsckStorageReader(path)),
}


def faulty(base: type, stage: str) -> type:
    """A subclass of ``base`` whose ``stage`` raises ValueError (``*_async``: returns a failed future)."""
    name = stage.removesuffix("_async")

    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        if stage.endswith("_async"):
            fut: Future[Any] = Future()
            fut.set_exception(ValueError(f"injected failure in {stage}"))
            return fut
        raise ValueError(f"injected failure in {stage}")

    return type(f"Faulty{base.__name__}", (base,), {name: broken})
