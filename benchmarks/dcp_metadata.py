"""The cost of a DCP checkpoint's metadata document (``dcp-metadata.json``) as it grows with tensors and ranks.

alpsck's DCP writer encodes DCP's ``Metadata`` as JSON at every save and decodes it again before it commits
(its self-check: it never commits what a load would refuse); every rank decodes it at every load. For
``--tensors`` tensors each split into ``--chunks`` row-wise chunks (FSDP's layout: one chunk per rank), this
times ``encode_metadata`` and ``decode_metadata`` (the best of ``--reps``), with Python's garbage collector
as the process has it (the functions pause it themselves while they build objects)::

    PYTHONPATH=. python benchmarks/dcp_metadata.py [--tensors 300] [--chunks 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from alpsck.dcp.formats import ExtentRef, decode_metadata, encode_metadata, extent_name


def metadata(tensors: int, chunks: int) -> Metadata:
    """``tensors`` float32 tensors of ``64 * chunks`` x 128, each in ``chunks`` row-wise chunks, chunk k on rank k."""
    sdm, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t}.weight"
        parts = []
        for c in range(chunks):
            offsets = [c * 64, 0]
            parts.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size([64, 128])))
            index = MetadataIndex(fqn, offsets)
            storage[index] = ExtentRef(c, extent_name(index, "tensor"), 64 * 128 * 4, "tensor")
        sdm[fqn] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                         size=torch.Size([64 * chunks, 128]), chunks=parts)
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=64, help="chunks per tensor (the ranks of an FSDP run)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    md = metadata(args.tensors, args.chunks)
    best = {"encode": float("inf"), "decode": float("inf")}
    data = b""
    for _ in range(args.reps):
        t = time.perf_counter()
        data = encode_metadata(md, step=1, world_size=args.chunks)
        best["encode"] = min(best["encode"], time.perf_counter() - t)
        t = time.perf_counter()
        decode_metadata(data, "dcp-metadata.json", step=1, world_size=args.chunks)
        best["decode"] = min(best["decode"], time.perf_counter() - t)
    print(f"{args.tensors} tensors x {args.chunks} chunks ({args.tensors * args.chunks} chunks, "
          f"{len(data) / 1e6:.2f} MB of JSON): encode {best['encode'] * 1e3:.1f} ms, decode {best['decode'] * 1e3:.1f} ms "
          f"(best of {args.reps})")


if __name__ == "__main__":
    main()
