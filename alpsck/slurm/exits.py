"""The exit codes a job step's tasks, and the health gate, end with: what each asks of the batch script, and of
whoever reads SLURM's record. Spelled here only."""

from __future__ import annotations

LOCAL_REQUEUE_EXIT = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
REQUEUE_EXIT = 3          # asks the batch script's EXIT trap to requeue
RESTART_EXIT = 75         # asks the batch script's restart loop to start the job step again (EX_TEMPFAIL)
# The run gave up (restarts without progress, the budget spent): do not requeue, do not restart. The
# code of NVIDIA's resiliency extension for the same outcome, so that a launcher built on its contract
# (or the extension itself, on GPU nodes) reads alpsck's verdict alike.
GIVE_UP_EXIT = 93
# Exit codes of a job step that end the batch script's restart loop: the run finished or was stopped
# (0), failed for good (1), asked for a requeue (3) or gave up (93). Any other (a signal's 128 + N, a
# hard exit, RESTART_EXIT) is a step that died: started again in the allocation while the budget lasts.
FINAL_EXITS = (0, 1, REQUEUE_EXIT, GIVE_UP_EXIT)
# The health gate's own answer to the batch script (alpsck.slurm.health_gate.main): it requeued the job (too few
# healthy nodes in this allocation), so the script ends without starting the step. 0 and GIVE_UP_EXIT as above.
GATE_REQUEUED_EXIT = 3
