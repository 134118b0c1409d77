"""The job layer's vocabulary holds (issue 53): the history's event kinds are spelled only in
alpsck/slurm/history.py, raw history events are read only by its reader and the timeline fold, and
SLURM's commands are run only by alpsck/slurm/commands.py."""

from __future__ import annotations

import ast
from pathlib import Path

from alpsck.slurm import history

PKG = Path(__file__).resolve().parents[2] / "alpsck"
EVENTS = PKG / "slurm" / "history.py"
FOLD = PKG / "slurm" / "timeline.py"
COMMANDS = PKG / "slurm" / "commands.py"
SLURM_COMMANDS = {"sbatch", "srun", "squeue", "sinfo", "sacct", "scontrol", "scancel"}
RUNNERS = {"run", "Popen", "call", "check_call", "check_output", "execv", "execvp", "execvpe", "spawnv", "spawnvp"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(encoding="utf-8"), str(p))) for p in sorted(PKG.rglob("*.py"))]


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants (text about the events may name them)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _where(p: Path, node: ast.AST) -> str:
    return f"{p.relative_to(PKG.parent)}:{getattr(node, 'lineno', '?')}"


def test_the_vocabulary_is_complete_and_every_kind_has_a_record() -> None:
    assert len(history.KINDS) >= 15 and all(k and k == c.KIND for k, c in history.KINDS.items())
    for name in ("step", "restart", "job_id", "seconds", "progress", "will_requeue"):  # typed by the records
        assert name in history._CHECKS


def _keys(tree: ast.Module) -> set[int]:
    """ids of the constants that are keys of another vocabulary: a dict display's keys and subscripts (a
    config key ``requeue.signal``, sbatch's ``--signal``, the status report's ``interval``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            out.update(id(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            out.add(id(node.slice))
    return out


def test_event_kinds_are_spelled_only_in_the_events_module() -> None:
    """A string literal equal to an event kind (not a docstring, a dict key or a subscript: words such as
    ``signal`` and ``interval`` name config and report keys too) appears nowhere in alpsck/ but in
    history.py: every other module names a kind by its record class (``Started.KIND``, ``isinstance``)."""
    kinds = set(history.KINDS)
    found = []
    for p, tree in _modules():
        if p == EVENTS:
            continue
        docs = _docstrings(tree) | _keys(tree)
        found += [f"{_where(p, n)}: {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in kinds and id(n) not in docs]
    assert not found, "event kinds spelled outside alpsck/slurm/history.py:\n" + "\n".join(found)


def test_raw_events_are_read_only_by_the_reader_and_the_fold() -> None:
    """Only history.py (the reader) and timeline.py (the fold) look into a raw event (its ``"event"``
    key) or name the reader's internals; everyone else reads the timeline."""
    found = []
    for p, tree in _modules():
        if p in (EVENTS, FOLD):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "event":
                found.append(f"{_where(p, n)}: [\"event\"]")
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
                    and isinstance(n.args[0], ast.Constant) and n.args[0].value == "event"):
                found.append(f"{_where(p, n)}: .get(\"event\")")
            if isinstance(n, ast.Attribute) and n.attr in ("normalise", "_event", "typed"):
                found.append(f"{_where(p, n)}: .{n.attr}")
    assert not found, "raw events read outside the reader and the fold:\n" + "\n".join(found)


def test_slurm_commands_are_run_only_by_the_commands_module() -> None:
    """No module but commands.py runs a SLURM command: no argument list that starts with one (an argv,
    whoever runs it), no subprocess call of one. The generated batch script's shell text is exempt: it
    is text (``srun``, ``scontrol requeue`` inside the script's lines), run by SLURM, never by alpsck."""
    found = []
    for p, tree in _modules():
        if p == COMMANDS:
            continue
        for n in ast.walk(tree):
            if (isinstance(n, ast.List) and n.elts and isinstance(n.elts[0], ast.Constant)
                    and isinstance(n.elts[0].value, str) and n.elts[0].value.split(" ")[0] in SLURM_COMMANDS):
                found.append(f"{_where(p, n)}: [{n.elts[0].value!r}, ...]")
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in RUNNERS
                    and isinstance(n.func.value, ast.Name) and n.func.value.id in ("subprocess", "os")):
                text = ast.unparse(n)
                if any(f"'{c}" in text or f'"{c}' in text for c in SLURM_COMMANDS):
                    found.append(f"{_where(p, n)}: {text[:80]}")
    assert not found, "SLURM commands run outside alpsck/slurm/commands.py:\n" + "\n".join(found)


def test_no_scontrol_is_read_in_one_place() -> None:
    users = [p for p, _ in _modules() if "ALPSCK_NO_SCONTROL" in p.read_text(encoding="utf-8")]
    assert users == [COMMANDS], users


def test_a_record_and_its_stored_line_round_trip_and_an_unknown_kind_is_kept() -> None:
    """The writer's line, read back, is the same record; a kind this version does not know (a newer
    writer's) keeps its name and every field, and a field the kind does not name stays in ``more``."""
    rec = history.record(history.Requeued(job_id="7", reason="timeout", progress=True, step=3), note="x")
    back = history.typed(history.normalise(rec) or {})
    assert isinstance(back, history.Requeued) and back.kind == "requeued" and back.progress is True
    assert back.more == {"note": "x"} and back.stored() == rec
    odd = history.normalise({"time": 5, "event": "future_kind", "step": 3, "more": 1, "other_kind": "z"})
    assert odd is not None
    rec2 = history.typed(odd)
    assert isinstance(rec2, history.Other) and rec2.kind == "future_kind" and rec2.get("step") == 3
    assert rec2.stored() == odd
    assert history.record("future_kind", job_id="1", x=2)["event"] == "future_kind"
