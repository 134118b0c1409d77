"""User scripts run as users run them (a child Python in a clone's root); the in-process cases are
tests/unit/test_user_scripts.py."""

from __future__ import annotations

from pathlib import Path

import alpsck


def _readme_library_example() -> str:
    """The README's "Checkpointing your own training loop" block, as a user pastes it."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("## Checkpointing your own training loop"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


def test_the_readmes_library_example_runs_pasted_in_the_clones_root(tmp_path: Path) -> None:
    """Run from the clone's root, Python imports ``alpsck`` from the source tree, which has no
    compiled core (it once died with "cannot import name '_core' ... circular import"); the source
    tree's ``_core.py`` loads the installed core instead. The example trains, checkpoints, and a
    second run resumes at its end."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = _readme_library_example()
    assert 'Checkpointer("runs/exp1"' in code
    code = code.replace('"runs/exp1"', repr(str(tmp_path / "exp1")))
    probe = ("import alpsck, os; print('CORE', alpsck._core.__file__); print('PKG', os.path.dirname(alpsck.__file__))\n"
             + code + "print('STEP', step)\n")
    for _ in ("trains", "resumes at its end"):
        out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line[:4] in ("CORE", "PKG ", "STEP"))
        assert Path(lines["PKG"]) == root / "alpsck", lines  # the source tree's package, really
        assert Path(lines["CORE"]).suffix == ".so" and not Path(lines["CORE"]).is_relative_to(root), lines
        assert lines["STEP"] == "1000", lines
    committed = [i["step"] for i in alpsck._core.scan(str(tmp_path / "exp1")) if i["status"] == "committed"]
    assert committed == [800, 900, 1000], committed  # keep_last=3


def test_the_source_trees_core_stand_in_says_what_to_do_without_an_installed_alpsck() -> None:
    """No installed alpsck on sys.path (``python -S``: no site-packages): the stand-in raises an
    ImportError that says to install, not a circular-import riddle."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-S", "-c", "import runpy; runpy.run_path('alpsck/_core.py')"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "ImportError: alpsck is imported from its source tree" in out.stderr, out.stderr[-2000:]
    assert "run `pip install .` in the clone first" in out.stderr
