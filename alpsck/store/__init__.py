"""The on-disk layer: a run directory and the checkpoints in it, as the core writes them.

:mod:`.run_dir` (names, scan, lock, the DCP marker), :mod:`.shards` (reading a checkpoint's
shards), :mod:`.durable` (Python's own durable writes). Nothing here imports a layer above it.
"""
