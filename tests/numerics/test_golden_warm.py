"""golden/warm.py: the golden's libraries imported in a thread while the image runs, so that judging waits for
the scoring alone; nothing where the host lacks them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

SCRIPT = """
import sys
from vllm_hotfix.golden import scoring, warm
assert "torch" not in sys.modules and "tokenizers" not in sys.modules
folder = sys.argv[2]  # no model there: the libraries load, the scorer's making fails, the check does it again
if sys.argv[1] == "lacking":
    scoring.missing = lambda: "torch is not installed on this host"
    assert warm.start(folder, ["a prompt"], {}) is None and "torch" not in sys.modules
    print("none")
else:
    thread = warm.start(folder, ["a prompt"], {})
    assert thread is not None and thread.daemon
    thread.join(120)
    assert "torch" in sys.modules and "tokenizers" in sys.modules
    assert warm.take(folder, ["a prompt"]) is None  # the work failed: nothing prepared, nothing left to take
    print("imported")
"""


def test_the_golden_libraries_load_in_a_thread_and_only_where_the_host_has_them(tmp_path: Path) -> None:
    for case, said in (("having", "imported"), ("lacking", "none")):
        done = subprocess.run([sys.executable, "-c", SCRIPT, case, str(tmp_path)], capture_output=True, text=True,
                              cwd=REPO, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == said, done.stderr
