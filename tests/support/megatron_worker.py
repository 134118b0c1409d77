"""One run of a tiny Megatron-LM GPT (megatron-core 0.16.1) on CPU for tests/ranks/test_megatron.py, checkpointed
through :mod:`alpsck.integrations.megatron`; started by ``torchrun`` (gloo), tensor-parallel over all its ranks.

``python megatron_worker.py CKPT_ROOT LOSSES_FILE [--kill-at N]``: 20 steps of a 2-layer GPT (hidden 32, 4 heads,
vocabulary 64, sequences of 16; Megatron's local layer spec, no Transformer Engine) with Adam, on batches drawn from
a generator seeded by the step; a checkpoint every 5 steps with ``dist_checkpointing.save(...,
sharded_strategy=alpsck's)``: the model's sharded state, the optimizer's (Megatron's own sharding of a torch
optimizer's state) and the step, into ``CKPT_ROOT/iter_000000N``, then ``latest_checkpointed_iteration.txt`` (as
Megatron-LM names them). Starts from the newest checkpoint when there is one that verifies
(``checked_latest``), loaded by ``dist_checkpointing.load`` (which picks alpsck's load strategy from the
checkpoint's metadata.json). Rank 0 appends each step's loss to
LOSSES_FILE (``step float.hex``). ``--kill-at N``: every rank SIGKILLs itself at the end of step N. Alone (no
``torchrun``) it is one rank. ``--async``: Megatron-LM's ``--async-save`` path, as its training loop runs it: each
save ``async_sharded_save=True`` through Megatron's ``AsyncCallsQueue`` (a forked process per save), the tracker
written by a finalize step, the queue polled without blocking after every step; before each save the one before
is finalized. A kill right after a save leaves that save unfinalized. ``--fully-parallel``: data-parallel over all
its ranks instead (each rank trains the same replica), saved as Megatron-LM's ``--ckpt-fully-parallel-save`` does
(``training_save_strategy``: the ranks share the writing of the replicated tensors) and loaded as its
``--ckpt-fully-parallel-load`` does (megatron-core's ``FullyParallelLoadStrategyWrapper`` around the strategy
``metadata.json`` names, exchanging with ``gather_object``: its default, ``broadcast``, needs CUDA).
``--mcore-local``: Megatron-LM's local checkpoints (``--non-persistent-ckpt-type local``) as its ``save_checkpoint``
and ``load_checkpoint`` make them: the state as a ``MCoreTensorAwareStateDict`` (algorithm "atomic") through alpsck's
``AlpsckLocalCheckpointManager`` in ``CKPT_ROOT/local``, resumed from its ``find_latest()``/``load()`` and
``to_state_dict``; with ``--async`` each save ``is_async=True`` through the same queue; with ``--memory`` the
manager's memory tier (every save waited for, its replica sent, before a kill). ``--fail-local-save-at N``:
the last rank's local save of step N holds a value alpsck cannot hold, so it fails on that rank only.

What megatron-core cannot do on a CPU, and how this worker gets past it (docs/megatron.md): its global memory
buffer asks ``torch.cuda.current_device()`` (here: "cpu"), and its model-parallel RNG tracker forks CUDA RNG states
(here: the inference tracker, whose fork does nothing; the model has no dropout, so no RNG is drawn).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from pathlib import Path

import torch
import torch.distributed as dist

STEPS, EVERY, SEQ, VOCAB = 20, 5, 16, 64


def cpu_shims() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *_a, **_k: None  # Megatron's async caller's, before it forks
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("losses")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--async", dest="async_save", action="store_true")
    ap.add_argument("--mcore-local", dest="local", action="store_true")
    ap.add_argument("--fully-parallel", dest="fully_parallel", action="store_true")
    ap.add_argument("--fail-local-save-at", dest="fail_at", type=int)
    ap.add_argument("--memory", action="store_true")
    a = ap.parse_args()
    if "RANK" not in os.environ:  # one process, not started by torchrun
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from alpsck.integrations import megatron as alpsck_megatron

    TRACKER = alpsck_megatron.TRACKER

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1 if a.fully_parallel else world)
    cpu_shims()
    alpsck_megatron.install()
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def state() -> dict:
        model_sd = model.sharded_state_dict()
        osd = opt.state_dict()
        osd["state"] = {pid: dict(s) for pid, s in osd["state"].items()}  # the live state's dicts: changed below
        counts = {pid: s.pop("step") for pid, s in osd["state"].items()}  # Adam's 0-d counts: not sharded
        optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(model_sd, model.parameters()))
        return {"model": model_sd, "optimizer": osd, "adam_steps": counts, "step": step}

    step = 0
    tracker = a.root / TRACKER
    manager = None
    if a.local:
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        from alpsck.integrations.megatron_local import AlpsckLocalCheckpointManager

        manager = AlpsckLocalCheckpointManager(a.root / "local", memory=a.memory)
    elif rank == 0 and tracker.exists():
        alpsck_megatron.checked_latest(a.root)  # a damaged newest iteration: the tracker set back to a valid one
    dist.barrier()
    latest = manager.find_latest() if manager is not None else int(tracker.read_text()) if tracker.exists() else -1
    if latest > 0:
        step = latest
        for p in model.parameters():  # Adam's state made (its shapes are the template the load fills), as
            p.grad = torch.zeros_like(p)  # Megatron's optimizers' init_state_fn: a zero step moves no weight
        opt.step()
        opt.zero_grad()
        if manager is not None:  # Megatron-LM's load_checkpoint, its local branch
            local, name = manager.load()
            loaded = local.to_state_dict(state(), algo="atomic")
            step = loaded["step"]  # Megatron-LM takes the iteration from the state loaded
            print(f"rank {rank}: resuming from iteration {step}: {name}", flush=True)
        elif a.fully_parallel:  # Megatron-LM's load_checkpoint with --ckpt-fully-parallel-load
            from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
            from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

            where = str(a.root / f"iter_{step:07d}")
            spread = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(where),
                                                      parallel_state.get_data_parallel_group(with_context_parallel=True),
                                                      False, "gather_object")
            loaded = dist_checkpointing.load(state(), where, sharded_strategy=spread)
        else:
            loaded = dist_checkpointing.load(state(), str(a.root / f"iter_{step:07d}"))
        model.load_state_dict(loaded["model"])
        for pid, count in loaded["adam_steps"].items():
            loaded["optimizer"]["state"][pid]["step"] = count
        opt.load_state_dict(loaded["optimizer"])
        assert loaded["step"] == step, (loaded["step"], step)
    strategy = alpsck_megatron.save_strategy()
    if a.fully_parallel:  # Megatron-LM's save_checkpoint with --ckpt-fully-parallel-save, from its args
        strategy = alpsck_megatron.training_save_strategy(argparse.Namespace(ckpt_fully_parallel_save=True,
                                                                             ckpt_assume_constant_structure=False))
    queue = AsyncCallsQueue() if a.async_save else None

    def track(iteration: int) -> None:  # Megatron-LM's: rank 0 names the newest iteration, once it is saved
        if rank == 0:
            tracker.write_text(str(iteration))

    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    pos = torch.arange(SEQ).unsqueeze(0).expand(4, -1)
    while step < STEPS:
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        loss = model(ids, pos, mask, labels=ids).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if rank == 0:
            with open(a.losses, "a") as f:
                f.write(f"{step} {float(loss.detach()).hex()}\n")
        if step % EVERY == 0 and manager is not None:  # Megatron-LM's save_checkpoint, its local branch
            whole = state()
            if step == a.fail_at and rank == world - 1:
                whole["unsaveable"] = object()
            local, _ = MCoreTensorAwareStateDict.from_state_dict(whole, algo="atomic")
            if queue is None:
                manager.save(local, step)
            else:
                queue.maybe_finalize_async_calls(blocking=True)
                queue.schedule_async_request(manager.save(local, step, is_async=True))
        elif step % EVERY == 0:
            where = a.root / f"iter_{step:07d}"
            if rank == 0:
                where.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            if queue is None:
                dist_checkpointing.save(state(), str(where), sharded_strategy=strategy)
                track(step)
                dist.barrier()
            else:
                queue.maybe_finalize_async_calls(blocking=True)
                request = dist_checkpointing.save(state(), str(where), sharded_strategy=strategy,
                                                  async_sharded_save=True)
                request.add_finalize_fn(lambda it=step: track(it))
                queue.schedule_async_request(request)
        elif queue is not None:
            queue.maybe_finalize_async_calls(blocking=False)
        if step == a.kill_at:
            if a.memory and manager is not None:
                manager.wait()  # the memory checkpoint's replica sent: a node lost now can be restored from it
            os.kill(os.getpid(), signal.SIGKILL)
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    if manager is not None:
        manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
