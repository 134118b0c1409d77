"""dcp-metadata.json's validation of tensor chunks (alpsck.dcp.formats): the layouts DCP writes round-trip, and
chunks that overlap, repeat or leave a hole are refused naming the tensor, whichever way they are laid out.

Crafted documents against a real checkpoint are tests/ranks/test_dcp.py::test_crafted_metadata_is_refused;
here the chunk checks alone, on many layouts, including the one-dimension fast path and the general one."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from alpsck.dcp.formats import ExtentRef, decode_metadata, encode_metadata, extent_name
from alpsck.errors import CorruptCheckpointError


def _metadata(size: list[int], boxes: list[tuple[list[int], list[int]]], fqn: str = "layers.0.w") -> Metadata:
    chunks, storage = [], {}
    for i, (offsets, sizes) in enumerate(boxes):
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        index = MetadataIndex(fqn, offsets)
        storage[index] = ExtentRef(i % 4, extent_name(index, "tensor"), 4 * int(torch.Size(sizes).numel()), "tensor")
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size), chunks=chunks)
    return Metadata(state_dict_metadata={fqn: md}, storage_data=storage)


def _document(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> bytes:
    """The JSON of a tensor with these chunks, written as encode_metadata writes a valid one."""
    good = _metadata(size, [([0] * len(size), size)])
    doc = json.loads(encode_metadata(good, step=1, world_size=4))
    doc["state_dict_metadata"]["layers.0.w"]["chunks"] = [[o, s, i % 4] for i, (o, s) in enumerate(boxes)]
    return json.dumps(doc).encode()


def _grid(size: list[int], parts: list[int]) -> list[tuple[list[int], list[int]]]:
    """Row-, column- or block-wise sharding: ``parts[d]`` equal pieces along dimension d."""
    steps = [n // p for n, p in zip(size, parts, strict=True)]
    return [([i * s for i, s in zip(idx, steps, strict=True)], steps)
            for idx in itertools.product(*(range(p) for p in parts))]


@pytest.mark.parametrize(("size", "parts"), [([64, 8], [64, 1]), ([8, 64], [1, 16]), ([16, 16], [4, 4]),
                                             ([6, 4, 8], [3, 2, 2]), ([10], [1])])
def test_sharded_layouts_round_trip(size: list[int], parts: list[int]) -> None:
    boxes = _grid(size, parts)
    random.Random(0).shuffle(boxes)  # DCP lists chunks by rank, not by position
    md = _metadata(size, boxes)
    back = decode_metadata(encode_metadata(md, step=1, world_size=4), "m", step=1, world_size=4)
    assert back.state_dict_metadata == md.state_dict_metadata
    assert {k: (v.rank, v.extent, v.nbytes) for k, v in back.storage_data.items()} == {
        k: (v.rank, v.extent, v.nbytes) for k, v in md.storage_data.items()}


BAD = {
    # rows 0-3 twice, rows 4-7 never: the volumes add up, the one-dimension check finds it
    "rows overlap": ([8, 2], [([0, 0], [4, 2]), ([2, 0], [4, 2])], "chunks 0 and 1 overlap"),
    "same box twice": ([8, 2], [([0, 0], [4, 2]), ([0, 0], [4, 2])], "appears twice"),
    # a 2-d grid with one block shifted onto its neighbour: the general check finds it
    "blocks overlap": ([4, 4], [([0, 0], [2, 2]), ([0, 1], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])],
                       "chunks 0 and 1 overlap"),
    "hole": ([8, 2], [([0, 0], [4, 2]), ([5, 0], [3, 2])], "hold 14 elements, the tensor has 16"),
    "outside": ([8, 2], [([0, 0], [4, 2]), ([6, 0], [4, 2])], "outside the size 8"),
    "offset not an integer": ([8, 2], [([0, 0], [4, 2]), ([4.0, 0], [4, 2])], r"chunks\[1\].offsets\[0\]"),
    "rank is a boolean": ([8, 2], [([0, 0], [8, 2])], None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_chunks_are_refused_naming_them(case: str) -> None:
    size, boxes, message = BAD[case]
    data = _document(size, boxes)
    if case == "rank is a boolean":
        doc = json.loads(data)
        doc["state_dict_metadata"]["layers.0.w"]["chunks"][0][2] = True
        data, message = json.dumps(doc).encode(), r"chunks\[0\].rank"
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_metadata(data, "m", step=1, world_size=4)


def test_random_layouts_agree_with_a_brute_force_overlap_check() -> None:
    """Boxes moved at random in one or two dimensions: refused exactly when two of them share an element."""
    rng = random.Random(1)
    for trial in range(300):
        size = [8, 6]
        boxes = _grid(size, [4, 1] if trial % 2 else [2, 3])
        i = rng.randrange(len(boxes))
        d = rng.randrange(2) if trial % 2 == 0 else 0
        offsets = list(boxes[i][0])
        offsets[d] = rng.randrange(0, size[d] - boxes[i][1][d] + 1)
        boxes[i] = (offsets, boxes[i][1])
        cells = [tuple(c) for o, s in boxes for c in itertools.product(*(range(a, a + n) for a, n in zip(o, s, strict=True)))]
        shared = len(cells) != len(set(cells))
        data = _document(size, boxes)
        if shared:
            with pytest.raises(CorruptCheckpointError, match="overlap|appears twice"):
                decode_metadata(data, "m", step=1, world_size=4)
        else:
            decode_metadata(data, "m", step=1, world_size=4)
