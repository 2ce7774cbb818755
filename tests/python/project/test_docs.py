"""Every ```python block of README.md and docs/*.md runs on its own, as pasted:
each in a fresh interpreter, in an empty directory, with nothing from the
blocks before it."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks():
    """(file relative to the repository, line of the block's first code line, code)."""
    blocks = []
    for path in DOCS:
        with open(path) as f:
            text = f.read()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start(1)) + 1
            blocks.append((os.path.relpath(path, ROOT), line, m.group(1)))
    return blocks


BLOCKS = python_blocks()


def test_the_docs_show_python_examples():
    assert BLOCKS, "README.md and docs/*.md show no ```python example"
    assert any(name == "README.md" for name, _, _ in BLOCKS), "README.md shows no ```python example"


@pytest.mark.parametrize("name,line,code", BLOCKS, ids=[f"{n}:{ln}" for n, ln, _ in BLOCKS])
def test_python_block_runs_alone(name, line, code, tmp_path):
    script = tmp_path / "block.py"
    # Blank lines in front keep the interpreter's line numbers those of the file.
    script.write_text("\n" * (line - 1) + code)
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    if r.returncode != 0:
        trace = r.stderr.replace(str(script), name)
        pytest.fail(
            f"the ```python block at {name}:{line} fails when pasted alone "
            f"(exit {r.returncode}):\n{trace[-4000:]}",
            pytrace=False,
        )
