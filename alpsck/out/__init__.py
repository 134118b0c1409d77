"""What the commands print, for every family of them (``slurm``, ``tools``, ``bench``, ``examples``):
strict JSON (:mod:`.jsonout`), text from files alpsck does not control escaped (:mod:`.textout`), and
matplotlib drawing to files (:mod:`.figures`). Free of torch and of every other alpsck module."""
