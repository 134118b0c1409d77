"""One run of a tiny ``accelerate`` training loop on CPU for tests/process/test_accelerate.py (one process) and
tests/ranks/test_accelerate_ddp.py (``torchrun``, DDP over gloo), checkpointed by
:class:`alpsck.integrations.accelerate.AcceleratorCheckpointer` as docs/huggingface.md's recipe does.

``python accelerate_worker.py RUN_DIR LOSSES_FILE [--kill-at N]``: 20 steps of a 2-layer MLP with dropout (the RNG
streams matter) over 24 shuffled samples (a seedable sampler), batch 4, a checkpoint every 5 steps, resuming from
RUN_DIR's newest checkpoint when it has one. Rank 0 appends each step's loss to LOSSES_FILE (``step float.hex``).
``--kill-at N``: every rank SIGKILLs itself at the end of step N, once every save so far is durable.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from alpsck.integrations.accelerate import AcceleratorCheckpointer
from support.tiny_classifier import Net, Samples

STEPS, EVERY = 20, 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("losses")
    ap.add_argument("--kill-at", type=int)
    a = ap.parse_args()
    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 25)
    model, opt, data, sched = acc.prepare(model, opt, DataLoader(Samples(), batch_size=4, shuffle=True), sched)
    with AcceleratorCheckpointer(acc, a.run_dir) as ckpt:
        step = ckpt.restore() or 0
        per_epoch = len(data)
        for epoch in range(step // per_epoch, STEPS):
            data.set_epoch(epoch)
            skip = step - epoch * per_epoch if epoch == step // per_epoch else 0
            for batch in ckpt.batches(data, skip=skip):
                model.train()
                loss = model(**batch)["loss"]
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                if acc.is_main_process:
                    with open(a.losses, "a") as f:
                        f.write(f"{step} {float(loss.detach()).hex()}\n")
                if step % EVERY == 0:
                    ckpt.save(step)
                if step == a.kill_at:
                    ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == STEPS:
                    return


if __name__ == "__main__":
    main()
