"""The command-line tools on a run directory: :mod:`.inspect_checkpoints`, :mod:`.prune`,
:mod:`.export`, :mod:`.doctor` (the installation), with :mod:`.progress` and :mod:`.jsonout` for
what they print. Each command module has a ``register(subparsers)`` that :mod:`alpsck.cli` calls.
"""
