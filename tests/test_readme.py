"""The README's Python snippets run as written (each in a fresh interpreter, from the repository root), on a
CPU machine through Triton's interpreter as on a GPU."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_readme_snippet_runs_as_written(code):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "TRITUNE_TEST"))}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the snippet failed:\n{code}\n--- stderr ---\n{r.stderr[-3000:]}"
    assert "Warning" not in r.stderr, f"the snippet warns:\n{r.stderr[-3000:]}"
