"""``alpsck bench``: alpsck against its peers and the hardware limit, measured in one run.

Modules: :mod:`.state` (a transformer-like state of a chosen size), :mod:`.limits` (raw O_DIRECT
bandwidth with fio, else through Python; a copy into pre-faulted memory), :mod:`.methods` (one
class per checkpointing method, same protocol), :mod:`.run` (the measurement loop, ratios,
recommended settings), :mod:`.report` (table, JSON, PNG), :mod:`.overhead` (the training's slowdown
at a checkpoint every k iterations), :mod:`.ranks` (several ranks). The torch.save
baseline, a peer, lives below the apps: :mod:`alpsck.torch_save` (:class:`alpsck.TorchSaveCheckpointer`).
"""
