"""The docs stay true to the code (issue 52): every ``alpsck`` command and flag the docs show exists, every
one the parser has is documented, every job config key docs/config.md lists is one ``alpsck submit``
accepts and the reverse, the examples use known keys only, every relative link and anchor resolves,
and a command line argparse refuses is one line (and a hint), never the usage block.

Pure in-process and fast: the parser is ``alpsck.cli.build_parser()``, the schema ``alpsck.slurm.config``.
When a test here fails after a change to the command line or the config, the message names the file to
edit and what to write there.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from alpsck import cli
from alpsck.slurm import config

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Where a mention of a command or flag must name a real one: the README and every docs page.
MENTION_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# The command reference: every subcommand and every flag must be documented on one of these.
REFERENCE_PAGES = [DOCS / "tools.md", DOCS / "slurm.md"]
LINK_PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((ROOT / "slurm").glob("**/README.md"))]


# ---------------------------------------------------------------------------------------------------
# Markdown, as far as these checks need it


@dataclass(frozen=True)
class Code:
    """A piece of code in a page: a fenced block's line, or an inline code span (newlines as spaces)."""

    page: Path
    line: int
    text: str
    section: str  # the text of the nearest heading above it


_FENCE = re.compile(r"^\s*(```|~~~)")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _where(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(text: str) -> Iterator[tuple[bool, int, str, str]]:
    """(fenced, first line number, text, section) for each fenced block and each run of prose between them."""
    lines = text.split("\n")
    section, fenced, start = "", False, 1
    buf: list[str] = []
    for n, line in enumerate(lines, 1):
        if _FENCE.match(line):
            yield fenced, start, "\n".join(buf), section
            fenced, start, buf = not fenced, n + 1, []
            continue
        if not fenced:
            m = _HEADING.match(line)
            if m:
                yield fenced, start, "\n".join(buf), section
                section, start, buf = m.group(2), n + 1, []
                continue
        buf.append(line)
    yield fenced, start, "\n".join(buf), section


def code_in(page: Path) -> list[Code]:
    out: list[Code] = []
    for fenced, start, text, section in _blocks(page.read_text()):
        if fenced:
            lines = text.split("\n")
            k = 0
            while k < len(lines):  # a shell line continued with a backslash is one line, numbered by its first
                first, line = k, lines[k]
                while line.endswith("\\") and k + 1 < len(lines):
                    k += 1
                    line = line[:-1] + " " + lines[k]
                if line.strip():
                    out.append(Code(page, start + first, line, section))
                k += 1
        else:
            out += [Code(page, start + text.count("\n", 0, m.start()), " ".join(m.group(2).split()), section)
                    for m in _SPAN.finditer(text)]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, without punctuation, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside fenced blocks), a repeated one with GitHub's ``-1``, ``-2``."""
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            s = slug(m.group(2))
            seen[s] = seen.get(s, -1) + 1
            seen[s if seen[s] == 0 else f"{s}-{seen[s]}"] = 0
    return set(seen)


# ---------------------------------------------------------------------------------------------------
# `alpsck <command> --flag` mentions


@dataclass(frozen=True)
class Mention:
    code: Code
    command: str      # a subcommand, or "" for the top-level parser (`alpsck --version`)
    flags: tuple[str, ...]

    def where(self) -> str:
        return f"{_where(self.code.page)}:{self.code.line}"


# `alpsck` where a command starts: at the start of the code (after a `$ ` prompt), after a shell separator,
# after ` / ` (two commands on one synopsis line), or after `python -m`; never as a word in a sentence or
# a comment (`# alpsck uses its own group`), nor as a flag's value (`--methods alpsck --iters 100`).
_ALPSCK = re.compile(r"(?:^\s*(?:\$\s+)?|(?:&&|\|\||;|\||\(|\s/)\s*|\bpython3? -m\s+)alpsck\s+(?=\S)")
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_COMMAND_END = re.compile(r"\s#|&&|\|\||;|\s\|\s+(?=[^\s-])")  # a comment, the next shell command


def mentions(code: Code) -> list[Mention]:
    """``alpsck CMD ...`` in a piece of code: the command, and the flags up to the next command or a comment."""
    out = []
    text = re.split(r"(?:^|\s)#", code.text)[0]  # a comment is prose
    starts = list(_ALPSCK.finditer(text))
    for k, m in enumerate(starts):
        end = starts[k + 1].start() if k + 1 < len(starts) else len(text)
        words = _COMMAND_END.split(text[m.end():end])[0].split()
        if not words:
            continue
        command = "" if words[0].startswith("-") else words[0]
        if command and not re.fullmatch(r"[a-z][a-z0-9-]*", command):
            continue  # `alpsck 0.169` in a table of results
        flags = tuple(dict.fromkeys(f for w in words[1 if command else 0:] for f in _FLAG.findall(w)))
        out.append(Mention(code, command, flags))
    return out


def all_mentions(pages: list[Path]) -> list[Mention]:
    return [mention for page in pages for code in code_in(page) for mention in mentions(code)]


# ---------------------------------------------------------------------------------------------------
# The parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return cli.build_parser()


@pytest.fixture(scope="module")
def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {"": parser, **subcommands(parser)}


def _shown(command: str, flag: str = "") -> str:
    return " ".join(x for x in ("alpsck", command, flag) if x)


def test_every_command_and_flag_the_docs_show_exists(commands: dict[str, argparse.ArgumentParser]) -> None:
    problems = []
    for m in all_mentions(MENTION_PAGES):
        if m.command not in commands:
            problems.append(f"{m.where()}: `{_shown(m.command)}`: no such command (the commands: "
                            f"{', '.join(sorted(c for c in commands if c))}); fix the page or add the command")
            continue
        known = flags_of(commands[m.command])
        problems += [f"{m.where()}: `{_shown(m.command, f)}`: `{_shown(m.command)}` has no {f} "
                     f"(its flags: {', '.join(sorted(known - {'-h', '--help'}))})"
                     for f in m.flags if f not in known]
    assert not problems, "the docs show commands or flags that do not exist:\n" + "\n".join(problems)


def synopsis() -> tuple[Path, int, dict[str, set[str]]]:
    """The command reference at the top of docs/tools.md (its first code block): command -> the flags its
    line shows ("" for ``alpsck --version``)."""
    page = DOCS / "tools.md"
    fenced = [(start, text) for is_fenced, start, text, _ in _blocks(page.read_text()) if is_fenced]
    assert fenced, "docs/tools.md has no code block: its first one is the command reference"
    start, text = fenced[0]
    shown: dict[str, set[str]] = {}
    for code in code_in(page):
        if start <= code.line < start + text.count("\n") + 1:
            for m in mentions(code):
                shown.setdefault(m.command, set()).update(m.flags)
    return page, start, shown


def sections(commands: dict[str, argparse.ArgumentParser]) -> dict[str, list[Code]]:
    """Subcommand -> the code of the sections the reference pages give it: a heading that names it in
    backticks (``## `prune` ``, ``## `alpsck status` ``, ``## `pin`, `unpin` ``)."""
    out: dict[str, list[Code]] = {c: [] for c in commands if c}
    headed: dict[str, set[str]] = {c: set() for c in out}
    for page in REFERENCE_PAGES:
        for _, _, _, section in _blocks(page.read_text()):
            for c in out:
                if re.search(rf"`(?:alpsck )?{re.escape(c)}`", section):
                    headed[c].add(section)
        for code in code_in(page):
            for c in out:
                if code.section in headed[c]:
                    out[c].append(code)
    return out


def _one_spelling(parser: argparse.ArgumentParser, flag: str, shown: set[str]) -> bool:
    """The flag is shown, under this spelling or another of the same option (``-o`` for ``--output``)."""
    return any(flag in a.option_strings and shown & set(a.option_strings) for a in parser._actions)


def test_every_command_and_flag_the_parser_has_is_documented(commands: dict[str, argparse.ArgumentParser]) -> None:
    """Two rules, so that a new command or flag is documented where a user looks: (1) the command reference
    at the top of docs/tools.md has a line ``alpsck CMD ...`` for every command, showing every flag; (2)
    every command has a section on docs/tools.md or docs/slurm.md (a heading that names it in backticks)
    whose text shows each of its flags in code: what it does."""
    page, line, shown = synopsis()
    where = f"{_where(page)}:{line}"
    problems = []
    for c, p in sorted(commands.items()):
        flags = sorted(flags_of(p) - {"-h", "--help"})
        if c not in shown:
            usage = " ".join(p.format_usage().split()).removeprefix("usage: ").replace(" [-h]", "")
            problems.append(f"{where}: the command reference has no line for `{_shown(c)}`: add `{usage}`")
            continue
        problems += [f"{where}: `{_shown(c, f)}`: not on the `{_shown(c)}` line of the command reference: add it"
                     for f in flags if not _one_spelling(p, f, shown[c])]
    pages = " or ".join(_where(p) for p in REFERENCE_PAGES)
    for c, codes in sorted(sections(commands).items()):
        if not codes:
            problems.append(f"`alpsck {c}` has no section: add one to {pages} (a heading: ## `{c}`) saying "
                            "what it does and what each flag does")
            continue
        said = {f for code in codes for f in _FLAG.findall(code.text)}
        problems += [f"`{_shown(c, f)}` is not described: say what it does in the section on `{c}` "
                     f"({', '.join(sorted({f'{_where(k.page)} ## {k.section}' for k in codes}))})"
                     for f in sorted(flags_of(commands[c]) - {"-h", "--help"}) if not _one_spelling(commands[c], f, said)]
    assert not problems, ("commands or flags the docs do not document (a new one: add it where each line says; "
                          "tests/unit/test_docs_cli.py explains the rules):\n" + "\n".join(problems))


def test_the_mention_scanner_sees_what_it_should() -> None:
    code = Code(ROOT / "x.md", 1, "alpsck pin RUN_DIR STEP / alpsck unpin RUN_DIR STEP  # alpsck nope --x", "")
    assert [(m.command, m.flags) for m in mentions(code)] == [("pin", ()), ("unpin", ())]
    code = Code(ROOT / "x.md", 1, "alpsck bench --dir d --methods alpsck,torch --plot docs/bench-2gib.png -o x", "")
    assert [(m.command, m.flags) for m in mentions(code)] == [("bench", ("--dir", "--methods", "--plot", "-o"))]
    assert [(m.command, m.flags) for m in mentions(Code(ROOT / "x.md", 1, "alpsck --version", ""))] == [("", ("--version",))]
    assert mentions(Code(ROOT / "x.md", 1, "alpsck 0.169 0.261", "")) == []
    for text in ("# alpsck uses its own gloo group", "a tree holding something alpsck refuses to decode"):
        assert mentions(Code(ROOT / "x.md", 1, text, "")) == []
    for text, want in (("alpsck bench --overhead --methods alpsck --iters 200", ("--overhead", "--methods", "--iters")),
                       ("alpsck status RUN | head -n 3", ()),
                       ("alpsck submit job.yaml [--wait | --no-wait]", ("--wait", "--no-wait")),
                       ("pip install . && alpsck submit q.yaml --local", ("--local",)),
                       ("$ alpsck prune run --keep-last 2", ("--keep-last",))):
        assert [m.flags for m in mentions(Code(ROOT / "x.md", 1, text, ""))] == [want], text


# ---------------------------------------------------------------------------------------------------
# Job config keys


def documented_config_keys() -> dict[str, list[tuple[str, int]]]:
    """``section.key`` (or ``key`` at the top level) -> where docs/config.md documents it: the first cell of
    each table row under "## Keys", in the section its heading (``### `requeue`: ...``) names."""
    page = DOCS / "config.md"
    out: dict[str, list[tuple[str, int]]] = {}
    in_keys, section = False, None
    for n, line in enumerate(page.read_text().split("\n"), 1):
        m = _HEADING.match(line)
        if m:
            level, title = len(m.group(1)), m.group(2)
            if level == 2:
                in_keys, section = title == "Keys", None
            elif in_keys:
                s = re.match(r"`(\w+)`", title)
                section = s.group(1) if s else "" if title.lower().startswith("top level") else None
            continue
        if not (in_keys and section is not None and line.startswith("|")):
            continue
        first = line.split("|")[1].strip()
        if first in ("key", "") or set(first) <= {"-", ":", " "}:
            continue
        for key in re.findall(r"`([^`]+)`", first):
            out.setdefault(f"{section}.{key}" if section else key, []).append((f"docs/config.md:{n}", n))
    return out


def schema_keys() -> set[str]:
    """Every key ``alpsck submit`` accepts: ``alpsck.slurm.config``'s tables, the ones parse_config checks
    a config against (``_TOP`` at the top level, ``_TYPES`` in each section)."""
    top = {k for k in config._TOP if k not in config._SECTIONS}
    return top | {f"{section}.{key}" for section, keys in config._TYPES.items() for key in keys}


def test_every_config_key_is_documented_and_every_documented_key_exists() -> None:
    docs, schema = documented_config_keys(), schema_keys()
    assert docs, "found no key table in docs/config.md (a heading renamed?)"
    problems = [f"{where}: `{key}` is documented but `alpsck submit` refuses it (not in alpsck/slurm/config.py's "
                "_TYPES): remove the row or add the key" for key in sorted(set(docs) - schema) for where, _ in docs[key]]
    problems += [f"docs/config.md: `{key}` is a config key (alpsck/slurm/config.py) with no row in its section's "
                 f"table (### `{key.split('.')[0]}` under ## Keys): add one" for key in sorted(schema - set(docs))]
    problems += [f"{docs[key][1][0]}: `{key}` has a second row" for key in sorted(docs) if len(docs[key]) > 1]
    assert not problems, "docs/config.md and the config schema disagree:\n" + "\n".join(problems)


def _config_keys(doc: object, where: str) -> list[str]:
    """The keys of a job config (or part of one), each wrong one as a problem naming where it is."""
    if not isinstance(doc, dict):
        return []
    problems = []
    for k, v in doc.items():
        if k not in config._TOP:
            problems.append(f"{where}: `{k}`: no such top-level key (the keys: {', '.join(config._TOP)})")
        elif k in config._SECTIONS and isinstance(v, dict):
            problems += [f"{where}: `{k}.{s}`: no such key (the {k} keys: {', '.join(config._TYPES[k])})"
                         for s in v if s not in config._TYPES[k]]
    return problems


def test_the_examples_and_the_docs_yaml_use_only_known_keys() -> None:
    problems = []
    examples = sorted((ROOT / "slurm" / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        problems += _config_keys(yaml.safe_load(path.read_text()), _where(path))
    for page in MENTION_PAGES:  # ```yaml blocks: a job config or part of one
        text = page.read_text()
        for m in re.finditer(r"^```ya?ml\n(.*?)^```", text, re.S | re.M):
            problems += _config_keys(yaml.safe_load(m.group(1)), f"{_where(page)}:{text.count(chr(10), 0, m.start()) + 2}")
    assert not problems, "unknown config keys:\n" + "\n".join(problems)


def test_the_config_key_reader_reads_the_tables() -> None:
    docs = documented_config_keys()
    assert {"name", "run_dir", "slurm.partition", "slurm.account", "requeue.in_job_restarts",
            "checkpoint.keep_last"} <= set(docs)


# ---------------------------------------------------------------------------------------------------
# Links


_LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(page: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of each markdown link outside code, its text over several lines or not."""
    for fenced, start, text, _ in _blocks(page.read_text()):
        if fenced:
            continue
        text = _SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # a link in code is no link
        for m in _LINK.finditer(text):
            yield start + text.count("\n", 0, m.end()), m.group(1)


def test_every_relative_link_and_anchor_resolves() -> None:
    problems = []
    for page in LINK_PAGES:
        for n, target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{_where(page)}:{n}: ({target}): no such file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{_where(page)}:{n}: ({target}): {_where(dest)} has no heading whose anchor is "
                                f"#{anchor} (its anchors: {', '.join(sorted(anchors(dest)))})")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_are_githubs() -> None:
    assert slug("`alpsck submit`") == "alpsck-submit"
    assert slug("The file system: Lustre layout and pre-flight") == "the-file-system-lustre-layout-and-pre-flight"
    assert slug("Reading a checkpoint before the model exists: `alpsck.peek`") == (
        "reading-a-checkpoint-before-the-model-exists-alpsckpeek")
    assert slug("`checkpoint`: `job.checkpoint_due(step)` and `job.checkpointer()`") == (
        "checkpoint-jobcheckpoint_duestep-and-jobcheckpointer")


# ---------------------------------------------------------------------------------------------------
# Command-line errors: one line (and a hint), exit 2


def _minimal_argv(parser: argparse.ArgumentParser) -> list[str]:
    """A command line the parser accepts: "1" for each positional and each required option."""
    argv: list[str] = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        if not a.option_strings:
            argv += ["1"] * (a.nargs if isinstance(a.nargs, int) else 1)
        elif a.required:
            argv += [a.option_strings[-1], "1"]
    return argv


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, list[str]]:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out = capsys.readouterr()
    assert out.out == ""
    return e.value.code, out.err.splitlines()


def _assert_one_line(code: object, err: list[str], prog: str, what: str) -> None:
    assert code == 2, (prog, what, code)
    assert 1 <= len(err) <= 2, f"{what}: {len(err)} lines:\n" + "\n".join(err)
    assert err[0].startswith(f"{prog}: error: ") and what in err[0], err
    assert not any(line.startswith("usage:") for line in err), err
    assert err[-1] == err[0] or f"{prog} --help" in err[-1], err


def test_a_bad_command_line_is_one_line_for_every_command(commands: dict[str, argparse.ArgumentParser],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for name, p in sorted(commands.items()):
        if not name:
            continue
        prog = _shown(name)
        # an unknown flag, blamed on the command it was given to (argparse's top parser would claim it)
        code, err = _refused([name, *_minimal_argv(p), "--no-such-flag"], capsys)
        _assert_one_line(code, err, prog, "unrecognized arguments: --no-such-flag")
        if _minimal_argv(p):  # a missing argument
            code, err = _refused([name], capsys)
            _assert_one_line(code, err, prog, "the following arguments are required")
    for argv, what in ((["no-such-command"], "invalid choice: 'no-such-command'"),
                       ([], "the following arguments are required: COMMAND"),
                       (["--no-such-flag"], "the following arguments are required: COMMAND")):
        code, err = _refused(argv, capsys)
        _assert_one_line(code, err, "alpsck", what)


@pytest.mark.parametrize("argv, what", [
    (["prune", "r", "--keep-last", "many"], "argument --keep-last"),
    (["status", "r", "--events", "-1"], "argument --events"),
    (["export", "r", "o.pt", "--format", "zip"], "argument --format"),
    (["inspect-checkpoints", "r", "--step"], "argument --step: expected one argument"),
])
def test_a_bad_value_is_one_line_naming_the_flag(argv: list[str], what: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _refused(argv, capsys)
    _assert_one_line(code, err, f"alpsck {argv[0]}", what)


def test_help_still_prints_the_whole_usage(commands: dict[str, argparse.ArgumentParser],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    for name, p in sorted(commands.items()):
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"] if name else ["--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0
        assert out.startswith(f"usage: {_shown(name)}"), out[:200]
        for f in flags_of(p):
            assert f in out, (name, f)
