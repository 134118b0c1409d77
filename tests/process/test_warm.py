"""support/warm.py's own guarantee: a warm process a test leaves running (it failed before it waited for its
ranks) is killed after the test, so that the test process ends and reports the failure instead of hanging at
exit in multiprocessing's join of its children (CI13 hung so, and only the CI's time limit would have ended it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from support import SUPPORT

PROBE = """
import time
from pathlib import Path

from support.warm import WarmProcess


def test_fails_with_its_rank_running(tmp_path: Path) -> None:
    script = tmp_path / "forever.py"
    script.write_text("import time\\nwhile True:\\n    time.sleep(0.05)\\n")
    p = WarmProcess(script, [], {"PATH": "/usr/bin:/bin"}, tmp_path / "out")
    time.sleep(0.5)
    assert p.poll() is None
    raise AssertionError("failed before it waited for its rank")
"""


def test_a_warm_process_left_running_by_a_failed_test_is_killed_and_the_session_ends(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(SUPPORT.parent / "conftest.py", tests / "conftest.py")
    (tests / "support").symlink_to(SUPPORT, target_is_directory=True)
    (tests / "test_probe.py").write_text(PROBE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        "-c", "/dev/null", str(tests)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr  # the test's own failure, reported: no hang
    assert "1 failed" in r.stdout and "warm processes still running after the test, killed: [" in r.stdout, r.stdout
