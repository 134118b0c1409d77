"""A node's health: the checks (:mod:`.checks`) the health gate (:mod:`alpsck.slurm.health_gate`) and ``alpsck
doctor --nodes`` run on each node, and the probe that runs them there (:mod:`.probe`)."""
