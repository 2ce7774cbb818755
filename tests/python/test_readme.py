"""README's code runs as pasted: every ```python block, in order, in one namespace."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def python_blocks():
    with open(README) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_examples():
    assert python_blocks(), "README.md shows no ```python example"


def test_readme_python_examples_run():
    namespace = {"__name__": "readme"}
    for block in python_blocks():
        exec(compile(block, README, "exec"), namespace)
