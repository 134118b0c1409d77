"""The CUDA staging path on a real GPU: the stall of a save against a plain pinned copy, how much of
the device-to-host copy the next iteration hides, and restoring to the GPU, against peers in the
same run.

The state: ``--layers`` Linear(``--width``, ``--width``) layers in fp32 on the GPU with AdamW
(weights + two moments: 12 bytes per parameter). One iteration: forward and backward of a
``--tokens`` x ``--width`` batch through them, then the optimizer step. Measured, ``--repeats``
times each, interleaved:

- ``iter``: an iteration without a save;
- ``pinned copy``: every state tensor copied to one pinned host buffer (synchronized): the floor;
- ``pageable copy``: ``t.cpu()`` of every state tensor (what a plain ``torch.save`` pays first);
- alpsck ``stall``: the seconds inside ``save()``; ``next iter``: the iteration right after it,
  whose optimizer step waits for the copy of the weights and moments; ``felt`` = stall + (next
  iter - iter), the training time the save cost; ``felt / pinned copy``; ``durable``: from the
  call to the fsync'ed commit;
- torch.save: ``torch.save(state_dict)`` + fsync, the training waiting for all of it;
- restore to the GPU: alpsck ``restore()`` into the live CUDA model and optimizer, against
  ``torch.load(map_location="cuda")`` + ``load_state_dict`` of the torch.save file, and a pinned
  host-to-device copy of the same bytes (the floor). The page cache is dropped first where this
  process may (root), else the reads may come from memory (said in the output).

    python benchmarks/gpu_staging.py --dir /tmp/bench --layers 24 --width 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn: Any) -> float:
    synchronize()
    t0 = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - t0


def training(layers: int, width: int, tokens: int, dev: torch.device) -> tuple[Any, Any, Any, list[torch.Tensor]]:
    """The benchmark's training, three iterations in (the optimizer has its moments): the model, its AdamW, one
    iteration (a function) and every state tensor; prints what it is."""
    assert dev.type == "cpu" or torch.cuda.is_available(), "needs a CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(tokens, width, device=dev)

    def iteration() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(3):
        iteration()
    tensors = [t for t in model.parameters()] + [v for st in opt.state.values() for v in st.values() if v.dim()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"{name}; torch {torch.__version__}; state {nbytes / 2**30:.2f} GiB "
          f"({len(tensors)} tensors); {layers} x Linear({width}) + AdamW; {tokens} tokens", flush=True)
    return model, opt, iteration, tensors


def pinned_copier(tensors: list[torch.Tensor], dev: torch.device) -> tuple[Any, Any]:
    """The floors: a copy of every tensor into one pinned host buffer, and back (each a function)."""
    pinned = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8,
                         pin_memory=dev.type == "cuda")

    def d2h() -> None:
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            pinned[pos:pos + n].copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            pos += n

    def h2d() -> None:
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            t.detach().reshape(-1).view(torch.uint8).copy_(pinned[pos:pos + n], non_blocking=True)
            pos += n
    return d2h, h2d


def parse_args(doc: str) -> argparse.Namespace:
    """The GPU benchmarks' command line (this one's and gpu_memory_tier.py's): where, the training's size, the
    repeats, a JSON file, the device."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the run directories go (removed afterwards)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script out on a machine without a GPU")
    return ap.parse_args()


def main() -> None:
    args = parse_args(__doc__)

    import alpsck

    dev = torch.device(args.device)
    model, opt, iteration, tensors = training(args.layers, args.width, args.tokens, dev)
    state = {"model": model, "optim": opt}
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"

    pinned_copy, pinned_h2d = pinned_copier(tensors, dev)

    def pageable_copy() -> None:
        for t in tensors:
            t.detach().cpu()

    run = args.dir / "alpsck-run"
    tfile = args.dir / "torch-save.pt"
    shutil.rmtree(run, ignore_errors=True)
    res: dict[str, list[float]] = {k: [] for k in ("iter", "pinned_copy", "pageable_copy", "stall", "next_iter",
                                                   "felt", "durable", "torch_save", "restore_alpsck", "restore_torch",
                                                   "pinned_h2d", "first_stall", "read_host",
                                                   "read_raw")}
    dropped = True
    with alpsck.Checkpointer(run, keep_last=2) as ck:
        ck.prepare(state)  # sizes, faults and pins the staging pool in the background
        time.sleep(0)
        for r in range(args.repeats + 1):
            res["iter"].append(sync_time(iteration))
            res["pinned_copy"].append(sync_time(pinned_copy))
            res["pageable_copy"].append(sync_time(pageable_copy))
            synchronize()
            t0 = time.perf_counter()
            h = ck.save(r + 1, state)
            stall = time.perf_counter() - t0
            nxt = sync_time(iteration)
            h.wait()
            durable = time.perf_counter() - t0
            if r == 0:  # the first save: the pool may still be faulting or pinning
                res["first_stall"].append(stall)
                print(f"first save: stall {stall:.3f} s, next iter {nxt:.3f} s, durable {durable:.2f} s", flush=True)
                continue
            res["stall"].append(stall)
            res["next_iter"].append(nxt)
            res["felt"].append(stall + nxt - res["iter"][-1])
            res["durable"].append(durable)

            def tsave() -> None:
                with open(tfile, "wb") as f:
                    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
            res["torch_save"].append(sync_time(tsave))
            print(f"round {r}: iter {res['iter'][-1]:.3f} pinned {res['pinned_copy'][-1]:.3f} "
                  f"pageable {res['pageable_copy'][-1]:.3f} | alpsck stall {stall:.3f} next iter {nxt:.3f} "
                  f"durable {durable:.2f} | torch.save {res['torch_save'][-1]:.2f} s", flush=True)
    from alpsck.restore import read_checkpoint
    from alpsck.store.picker import pick

    newest = Path(pick(run, kind="alpsck").candidates[0]["path"])
    buf = bytearray(16 << 20)

    def read_raw() -> None:  # every file of the checkpoint, read sequentially: the disk's part
        for f in sorted(p for p in newest.rglob("*") if p.is_file()):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    for r in range(args.repeats):
        res["pinned_h2d"].append(sync_time(pinned_h2d))
        dropped &= drop_caches()
        res["read_raw"].append(sync_time(read_raw))
        dropped &= drop_caches()
        res["read_host"].append(sync_time(lambda: read_checkpoint(newest)))
        dropped &= drop_caches()
        with alpsck.Checkpointer(run) as ck:
            res["restore_alpsck"].append(sync_time(lambda ck=ck: ck.restore(state)))
        dropped &= drop_caches()

        def tload() -> None:
            sd = torch.load(tfile, map_location=dev, weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
        res["restore_torch"].append(sync_time(tload))
        print(f"restore {r}: alpsck {res['restore_alpsck'][-1]:.2f} s, torch.load {res['restore_torch'][-1]:.2f} s, "
              f"pinned H2D {res['pinned_h2d'][-1]:.3f} s; read to host {res['read_host'][-1]:.2f} s, "
              f"the files read raw {res['read_raw'][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in res.items() if v}
    gb = nbytes / 1e9
    print(f"\nmedians of {args.repeats} ({'page cache dropped before each restore' if dropped else 'page cache NOT dropped'}):")
    print(f"  iteration {med['iter']:.3f} s; pinned D2H copy {med['pinned_copy']:.3f} s ({gb / med['pinned_copy']:.1f} GB/s); "
          f"pageable {med['pageable_copy']:.3f} s ({gb / med['pageable_copy']:.1f} GB/s)")
    print(f"  alpsck: stall {med['stall']:.4f} s, next iteration {med['next_iter']:.3f} s, felt {med['felt']:.3f} s = "
          f"{med['felt'] / med['pinned_copy']:.2f}x the pinned copy; durable {med['durable']:.2f} s "
          f"({gb / med['durable']:.2f} GB/s); first save's stall {med['first_stall']:.3f} s")
    felt = max(med["felt"], 1e-6)
    print(f"  torch.save + fsync (training waits): {med['torch_save']:.2f} s = {med['torch_save'] / felt:.0f}x alpsck's felt")
    print(f"  restore to GPU: alpsck {med['restore_alpsck']:.2f} s ({gb / med['restore_alpsck']:.2f} GB/s), "
          f"torch.load {med['restore_torch']:.2f} s ({gb / med['restore_torch']:.2f} GB/s); pinned H2D {med['pinned_h2d']:.3f} s")
    print(f"  of which: alpsck's read to host memory {med['read_host']:.2f} s ({gb / med['read_host']:.2f} GB/s); "
          f"the checkpoint's files read raw {med['read_raw']:.2f} s ({gb / med['read_raw']:.2f} GB/s)")
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "device": name, "dropped": dropped,
                                         "medians": med, "all": res}, indent=1))
    shutil.rmtree(run, ignore_errors=True)
    tfile.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
