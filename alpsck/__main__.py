"""``python -m alpsck``: the same as the ``alpsck`` command."""

import sys

from .cli import main

sys.exit(main())
