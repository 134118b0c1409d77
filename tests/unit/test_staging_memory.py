"""The staging memory as the kernel sees it: not inherited by fork(), on base pages.

- Not inherited (MADV_DONTFORK, VmFlags "dc"): otherwise every page of it is shared
  copy-on-write while a forked child (a DataLoader worker) lives, and the parent's next save
  takes a page fault and a page copy per page (measured: 0.58 s against 0.03 s for a 256 MB
  state).
- On base pages, never advised MADV_HUGEPAGE (VmFlags "hg"), even where the kernel offers
  transparent huge pages: on this project's VM a huge-page pool took about 3x longer to fault in,
  and a pool prepared during 5 s of training was then often not ready for the first save
  (docs/benchmarks.md, stop 36). The restore's read buffers take huge pages; the C++ test
  test_platform.cc checks that mapping.
- Kept for the process's next engine once its Checkpointer closes (one spare, the newest): an
  integration that opens a Checkpointer per checkpoint path (Lightning's CheckpointIO) copies
  into memory already faulted in, and ``alpsck.release_staging_memory()`` gives it back.
"""

from __future__ import annotations

from pathlib import Path

import torch
from support.smaps import mapping_field

import alpsck

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}  # 4 MiB


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr``."""
    return mapping_field(addr, "VmFlags")


def _huge_page_size() -> int:
    """The kernel's transparent huge page size, 0 when it has none or has them set to "never"."""
    try:
        enabled = (THP / "enabled").read_text()
        size = int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0
    return 0 if "[never]" in enabled or "[" not in enabled else size


def test_the_staging_memory_is_not_inherited_by_a_fork(tmp_path: Path) -> None:
    state = _state()
    with alpsck.Checkpointer(tmp_path / "run") as ck:
        ck.save(1, state).wait()  # the pool exists once a copy-mode save ran
        addr = int(ck.engine.staging_address)
        assert addr and ck.engine.staging_bytes > 0
        assert "dc" in _vm_flags(addr), "the staging pool would be shared copy-on-write with forked children"


def test_the_staging_pool_stays_on_base_pages_where_the_kernel_offers_huge_ones(tmp_path: Path) -> None:
    huge = _huge_page_size()
    with alpsck.Checkpointer(tmp_path / "run", chunk_bytes=1 << 20) as ck:
        ck.save(1, _state()).wait()
        addr, size = int(ck.engine.staging_address), int(ck.engine.staging_bytes)
        flags = _vm_flags(addr)
        assert "hg" not in flags, f"pool advised MADV_HUGEPAGE: VmFlags {flags}"
        assert addr % 4096 == 0 and size > 0
        print(f"transparent huge pages {huge} bytes; pool of {size} bytes at {addr:#x}: VmFlags {flags}")


def test_a_closed_checkpointers_staging_memory_serves_the_next_and_is_given_back_on_request(tmp_path: Path) -> None:
    alpsck.release_staging_memory()
    state = _state()
    with alpsck.Checkpointer(tmp_path / "a.ckpt", keep_last=1) as ck:
        ck.save(1, state).wait()
        addr, size = int(ck.engine.staging_address), int(ck.engine.staging_bytes)
    assert alpsck.release_staging_memory() == size  # kept after close: given back on request
    assert alpsck.release_staging_memory() == 0
    with alpsck.Checkpointer(tmp_path / "b.ckpt", keep_last=1) as ck:
        ck.save(1, state).wait()
        addr = int(ck.engine.staging_address)
        touched = int(mapping_field(addr, "Rss")[0])  # kB: the pages the save's copy faulted
    with alpsck.Checkpointer(tmp_path / "c.ckpt", keep_last=1) as ck:  # the next path: the same memory
        ck.save(2, state).wait()
        assert int(ck.engine.staging_address) == addr
        assert int(mapping_field(addr, "Rss")[0]) >= touched
    got = {k: torch.empty_like(v) for k, v in state.items()}
    assert alpsck.restore_into(tmp_path / "c.ckpt", got) == 2
    assert all(torch.equal(got[k], state[k]) for k in state)  # the reused memory's old bytes wrote nothing
    assert alpsck.release_staging_memory() == size
