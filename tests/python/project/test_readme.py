"""README.md is a newcomer's first page: what radixkv is, the two set-up
commands exactly, under 200 lines, a map of docs/ that matches docs/, and no
path outside the repository anywhere in the docs. (test_docs.py runs every
```python block of README.md and docs/*.md, each on its own.)"""

import glob
import os
import re

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
README = os.path.join(ROOT, "README.md")

SETUP = """```
bash .ci/main    # build radixkv, then replay the built-in chat workload through the cache
bash .ci/test    # build everything, then run all tests: ctest, pytest, sanitizers, leak check,
                 # and radixkv inside real SGLang and vLLM servers against their own caches
```"""


def read(path):
    with open(path) as f:
        return f.read()


def test_readme_opens_with_what_it_is_then_the_two_commands():
    text = read(README)
    assert text.startswith(
        "# radixkv\n\nradixkv is the KV-cache memory subsystem of an LLM serving engine"
    )
    first_block = text.index("```")
    assert text[first_block:].startswith(
        SETUP
    ), "README's first code block must be the two commands"
    assert "## " not in text[:first_block], "the two commands come before any section"


def test_readme_is_short():
    lines = read(README).count("\n")
    assert lines < 200, f"README.md has {lines} lines; details belong in docs/"


def test_readme_has_python_examples():
    assert re.search(r"^```python\n", read(README), re.M), "README.md shows no ```python example"


def test_readme_draws_the_tiers():
    assert re.search(r"^```mermaid\n", read(README), re.M)


def test_the_docs_map_matches_docs():
    text = read(README)
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)\)", text))
    present = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))}
    assert (
        linked == present
    ), f"README's map of docs/: missing {present - linked}, dead {linked - present}"


def test_relative_links_lead_somewhere():
    for path in [README] + glob.glob(os.path.join(ROOT, "docs", "*.md")):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", read(path)):
            where = os.path.normpath(os.path.join(os.path.dirname(path), target))
            assert os.path.exists(
                where
            ), f"{os.path.relpath(path, ROOT)} links to {target}, which is not there"


def test_nothing_points_outside_the_repository():
    docs = [README, os.path.join(ROOT, "bench", "README.md")] + glob.glob(
        os.path.join(ROOT, "docs", "*.md")
    )
    for path in docs:
        for n, line in enumerate(read(path).splitlines(), 1):
            assert (
                "../shared" not in line and "shared/traces" not in line
            ), f"{os.path.relpath(path, ROOT)}:{n} names a path outside the repository"


def test_there_is_a_license():
    assert "Apache License" in read(os.path.join(ROOT, "LICENSE"))
