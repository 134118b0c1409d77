"""Stands in for the C++ core (``_core``, the nanobind extension) where Python imports ``alpsck``
from its source tree, e.g. a script or ``python`` started in the clone's root after ``pip install .``.

An installed alpsck has the compiled ``_core.<tag>.so`` beside this file, and Python's importer
takes an extension module before a ``.py`` of the same name, so this file is never run there. In the
source tree no extension is built; this module then loads the installed copy's extension in its
place (the first ``alpsck/_core`` extension on ``sys.path`` outside this directory): the Python
code is then this tree's and the core the installed one's (after changing ``cpp/``, reinstall).
Without an installed copy it says how to get one.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))


def _installed_extension() -> str | None:
    for entry in sys.path:
        package = os.path.join(entry or os.getcwd(), "alpsck")
        if not os.path.isdir(package) or os.path.realpath(package) == _HERE:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(package, "_core" + suffix)
            if os.path.isfile(path):
                return path
    return None


def _load(path: str) -> None:
    loader = importlib.machinery.ExtensionFileLoader(__name__, path)
    spec = importlib.util.spec_from_file_location(__name__, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[__name__] = module  # `from . import _core` now finds the extension itself


_found = _installed_extension()
if _found is None:
    raise ImportError(
        f"alpsck is imported from its source tree ({_HERE}), where its C++ core is not built, and no installed "
        "alpsck was found on sys.path: run `pip install .` in the clone first (see README.md)")
_load(_found)
