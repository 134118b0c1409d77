"""The SLURM layer: ``alpsck submit``, stop signals, final checkpoint, requeue and resume.

Modules: :mod:`.config` (YAML schema), :mod:`.submit` (submitit executors, sbatch script),
:mod:`.runner` (what runs inside the job), :mod:`.stop` (signals, maintenance),
:mod:`.context` (the JobContext an entry point receives), :mod:`.history` (history.jsonl: the events
as records, one writer, one reader), :mod:`.timeline` (the fold every reader of the events asks),
:mod:`.status` (``alpsck status``'s report), :mod:`.commands` (every SLURM command).
"""

from .config import ConfigError, JobConfig, load_config, parse_config
from .context import JobContext, current_job

__all__ = ["ConfigError", "JobConfig", "JobContext", "current_job", "load_config", "parse_config"]
