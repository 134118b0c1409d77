"""A torch.distributed.checkpoint (DCP) storage backend on the alpsck core, so DCP's planner reshards.

Use it where a checkpoint must load at another world size (or another sharding) than it was saved
with; at the same world size, :class:`alpsck.Checkpointer` restores directly::

    import torch.distributed.checkpoint as dcp
    from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter

    dcp.save(state_dict, storage_writer=AlpsckStorageWriter("runs/exp1", step))   # every rank
    dcp.load(state_dict, storage_reader=AlpsckStorageReader("runs/exp1"))        # any world size

On disk a DCP checkpoint is an ordinary alpsck checkpoint (``docs/format.md``), so
``alpsck inspect-checkpoints``, verification (``_core.scan``) and retention treat it like any
other: each rank writes ``RUN_DIR/step-N.tmp/rank-RRRRR.bin`` through its own core
:class:`alpsck._core.Engine` (one extent per DCP write item, CRC32C on every chunk, O_DIRECT,
``commit="deferred"``), and the coordinator commits the step with the DCP metadata as the extra
file ``dcp-metadata.json``, once every rank's shard is durable. The commit is the core's atomic
rename, so a crash at any point leaves either the whole checkpoint or none of it.

Call order (DCP drives it; see ``torch/distributed/checkpoint/storage.py``).
Save: ``storage_meta()`` and ``set_up_storage_writer()`` (all ranks) -> ``prepare_local_plan()``
(all ranks) -> ``prepare_global_plan()`` (coordinator: stamps every plan with its rank and the
world size, then opens the coordinator's engine, whose start-up removes abandoned ``step-*.tmp``
directories) -> ``write_data()`` (all ranks: the other ranks open their engines only now, after
the coordinator's clean-up; returns once this rank's shard is sealed and durable) -> ``finish()``
(coordinator: :func:`alpsck._core.commit_step`, then retention).
Load: ``read_metadata()`` (all ranks: picks the step, checks ``dcp-metadata.json`` against the
manifest's CRC32C, parses it with explicit validation) -> ``set_up_storage_reader()`` ->
``prepare_local_plan()`` -> ``prepare_global_plan()`` (coordinator: every rank must have picked the
same step) -> ``read_data()`` (each shard opened once; extents read in file order, in batches,
every chunk CRC-checked; straight into the destination when it is a whole, contiguous CPU chunk).

No pickle, ever. DCP's own FileSystemWriter pickles its Metadata and every non-tensor value;
here the Metadata is JSON (schema in ``docs/format.md``), rebuilt on read from a fixed set of
types (tensor dtypes from :data:`alpsck.tree.TENSOR_DTYPES`; unknown types, fields, dtypes or
layouts raise :class:`UnsafeCheckpointError`, inconsistent sizes and offsets
:class:`CorruptCheckpointError`, each naming the field). Non-tensor values (DCP's ``BYTE_IO``
items: ints, floats, strings, tuples, dicts ... that DCP would ``torch.save``) are stored as
alpsck's tagged JSON (:mod:`alpsck.tree`, plus NumPy arrays and scalars, sets, named tuples and tensors
inside a value: :mod:`.formats`), taken from the planner's ``lookup_object`` (so DCP's own pickle of
them is never written); a value JSON cannot hold (a custom class) fails the save with
:class:`UsageError`; ``bytes`` and ``io.BytesIO`` values (torchtitan's dataloader and train state) are
stored as their bytes. A save planner with its own ``resolve_data``/``transform_object`` has its bytes
stored as they are, for its load planner's ``load_bytes``. On load a value is decoded from JSON, put
in the live value's type where JSON lost it, and set where DefaultLoadPlanner would set it, with no
pickle at all; a planner with its own ``load_bytes`` gets a ``torch.save`` of the decoded value, made
here in memory: what it unpickles was never read from disk. docs/dcp.md lists what is refused.

Locking: a writer takes the run directory's per-rank writer lock
(:func:`alpsck.store.lock.lock_run_dir`) while it writes: the coordinator in
``prepare_global_plan`` (its engine's start-up tidies the directory; the generation is chosen),
every rank during ``write_data``, and the coordinator again for the commit and retention in
``finish``. No lock is held between those calls, so a save that DCP abandons in between leaves
none. A DCP save and an open :class:`alpsck.Checkpointer` (or another job) on the same run
directory fail with :class:`RunDirLockedError` instead of removing each other's directories.
Readers take no lock.

Threading: a writer or reader serves one save or load at a time, driven by DCP on one thread per
rank (``async_save`` runs the whole save on its background thread). Long core calls release the
GIL. In a run directory a step is written once (a committed step raises UsageError) unless it is
unusable or ``overwrite=True`` (then it and the newer steps are retired first, one history); a checkpoint
directory is written over by each save to it. ``use_collectives=False`` saves every rank alone (with
several ranks each in ``ID/__<rank>``); any process rank may be DCP's coordinator (it writes shard 0).

Checkpoint-directory mode (``dcp.save(..., checkpoint_id="folder/step-10")``, as torchtitan names
its checkpoints): the named directory is a run directory of its own, each save the next generation
of it; ``finish`` commits the generation, then writes the ``.metadata`` marker DCP trainers look
for (JSON, ``alpsck.store.names.MARKER_BYTES``), then removes the older generations, so an overwrite
leaves the old checkpoint loadable until the new one is committed. The coordinator picks the
generation under the lock in ``prepare_global_plan`` and sends it to every rank in its plan.

Modules: :mod:`.writer` the writer and :mod:`.extents` a rank's write items as its shard's extents;
:mod:`.reader` the reader and :mod:`.load_plan` what a load's ranks agree and put back (the writer and the
reader are exported here); :mod:`.paths` what a checkpoint_id names; :mod:`.formats` the JSON of DCP's
Metadata. Non-tensor values are encoded below the backend (:mod:`alpsck.store.values`).
"""

from .formats import METADATA_FILE
from .reader import AlpsckStorageReader, load
from .writer import AlpsckStorageWriter

__all__ = ["METADATA_FILE", "AlpsckStorageReader", "AlpsckStorageWriter", "load"]
