"""Reading a checkpoint back: one directory (:func:`read_checkpoint`), its non-tensor state without a
model (:func:`peek`), and the multi-rank restore protocol (:func:`restore_into`), which
:meth:`alpsck.Checkpointer.restore` runs; the health of a loss (:func:`loss_problem`) and the
in-process rollback on a bad one (:class:`Rollback`).

One concept a module: :mod:`.read` (one directory, peek), :mod:`.into` (the multi-rank protocol),
:mod:`.health` (what makes a loss or a run's checkpoints unhealthy), :mod:`.rollback` (rolling back
in the training loop, and its records in the run directory).

Which checkpoint is read is the picker's answer (:func:`alpsck.store.picker.pick`; the rule:
docs/guarantees.md, "Which checkpoint a restore uses"). With several ranks, rank 0's candidates are
tried in order, and a checkpoint any rank cannot read is skipped by all (:class:`alpsck.ranks.Ranks`
carries the votes). Nothing read back is ever unpickled.
"""

from __future__ import annotations

from ..progress import RESTORED_HOOKS  # re-exported (the list lives there, importable without torch)
from .health import SPIKE_WINDOW, all_unhealthy, loss_problem
from .into import restore_into
from .read import peek, read_checkpoint
from .rollback import ROLLBACKS_FILE, Rollback, RollbackRecord, read_rollbacks

__all__ = ["RESTORED_HOOKS", "ROLLBACKS_FILE", "SPIKE_WINDOW", "Rollback", "RollbackRecord", "all_unhealthy",
           "loss_problem", "peek", "read_checkpoint", "read_rollbacks", "restore_into"]
