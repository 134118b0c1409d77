"""Hostile job configs: a good one to start from, and the ways to spoil it (the setup blocks left open, values as
JSON strings)."""

from __future__ import annotations

GOOD = """\
name: t
run_dir: {run_dir}
slurm:
  time: "00:02:00"
entry:
  function: alpsck.examples.llama.train:slurm_entry
"""


def with_setup(good: str, lines: list[str]) -> str:
    items = "".join(f"    - {json_str(x)}\n" for x in lines)
    return good + f"environment:\n  setup:\n{items}"


def json_str(text: str) -> str:
    """A YAML double-quoted scalar holding ``text`` (JSON's escapes are YAML's)."""
    import json
    return json.dumps(text)


OPEN_BLOCKS = [
    ["cat <<EOF"],                      # an unterminated here-document: bash -n only warns
    ["cat <<'EOF'", "x"],
    ["cat <<-EOF", "x", "  EOF"],        # <<- strips tabs, not spaces: still open
    ["echo 'a"],                        # quotes
    ['echo "a'],
    ["echo `ls"],
    ["echo $(ls"],                      # substitutions
    ["echo $((1 +"],
    ["if true; then", "echo a"],        # compound commands
    ["for i in 1 2; do"],
    ["case x in"],
    ["{ echo a"],
    ["( echo a"],
    ["f() {"],
    ["echo a \\"],                      # a trailing backslash joins the next line
    ["export B=1", "echo a \\\\\\"],    # an odd number of them
]
