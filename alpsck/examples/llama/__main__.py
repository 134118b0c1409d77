"""``python -m alpsck.examples.llama``: see :mod:`alpsck.examples.llama.train`."""

from __future__ import annotations

from alpsck.examples.llama.train import main

raise SystemExit(main())
