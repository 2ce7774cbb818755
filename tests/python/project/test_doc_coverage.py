"""Docs that cannot drift: docs/architecture.md names every module of the
package and of the native sources, docs/api.md gives every public
`CacheManager` method, property and constructor argument, and no file of the
repository names a document the repository lacks."""

import ast
import inspect
import pathlib
import re
import subprocess

import pytest

from radixkv.scheduler import CacheManager

ROOT = pathlib.Path(__file__).resolve().parents[3]
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()
NATIVE = {"cpp/src": (".cc", ".h"), "cpp/include/radixkv": (".h",), "cuda": (".cu", ".cuh", ".h")}
NATIVE["bindings"] = (".cc", ".h")


def _layout_entry(directory: str) -> str:
    """The lines of architecture.md's Layout block from `directory`'s entry
    to the next entry (an unindented line)."""
    block = ARCHITECTURE.split("## Layout", 1)[1].split("```")[1]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(directory))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1].strip()), len(lines))
    return "\n".join(lines[start:end])


def _named(stem: str, names, text: str) -> bool:
    """Whether `text` names a module: one of its file `names`, or its stem as
    a whole word."""
    if any(re.search(r"(?<![\w/.])" + re.escape(n) + r"\b", text) for n in names):
        return True
    return re.search(r"(?<![\w.])" + re.escape(stem) + r"(?![\w])", text) is not None


def python_modules():
    package = ROOT / "python" / "radixkv"
    for path in sorted(package.rglob("*.py")):
        if path.name != "__init__.py":
            yield path.relative_to(package).as_posix()


def native_sources():
    for directory, suffixes in NATIVE.items():
        for path in sorted((ROOT / directory).rglob("*")):
            if path.suffix in suffixes:
                yield path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("module", list(python_modules()))
def test_architecture_names_each_python_module(module):
    """Named in full anywhere (`scheduler/upkeep.py`, `upkeep.py`,
    `radixkv.scheduler.upkeep`), or by its stem in the Layout block's entry
    of the package."""
    path = pathlib.PurePosixPath(module)
    dotted = "radixkv." + ".".join(path.with_suffix("").parts)
    if path.name in ARCHITECTURE or dotted in ARCHITECTURE:
        return
    entry = _layout_entry("python/radixkv/")
    assert _named(path.stem, [], entry), (
        f"docs/architecture.md names no module {module}: add it to the concept table or the "
        "Layout block"
    )


@pytest.mark.parametrize("source", list(native_sources()))
def test_architecture_names_each_native_source(source):
    """A .cc is named with its header: `foo.h` or `foo.cc` names both."""
    stem = pathlib.PurePosixPath(source).stem
    names = [stem + s for s in (".h", ".cc", ".cu", ".cuh")]
    assert _named(stem, names, ARCHITECTURE), f"docs/architecture.md names no {source}"


def test_the_module_check_would_see_a_missing_module():
    entry = _layout_entry("python/radixkv/")
    assert _named("tiers", [], entry)
    assert not _named("no_such_module", [], entry)
    assert not _named("tiers", [], "host_tiers and tiers_of")


def public_members():
    """CacheManager's public methods and properties, its bases' included
    (the page path's steps are PagePath's)."""
    return sorted(
        {
            name
            for cls in CacheManager.__mro__[:-1]  # (not object's)
            for name, value in vars(cls).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))
        }
    )


def constructor_arguments():
    params = inspect.signature(CacheManager.__init__).parameters
    return [name for name in params if name != "self"]


@pytest.mark.parametrize("name", public_members())
def test_api_gives_each_cache_manager_member(name):
    assert re.search(r"(`|cm\.)" + re.escape(name) + r"[`(]", API), (
        f"docs/api.md gives no CacheManager.{name}"
    )


def test_api_gives_each_constructor_argument_in_the_signature_and_the_table():
    """The signature in "Making one" is the class's, argument by argument and
    default by default, and the table after it names each argument."""
    section = API.split("## Making one", 1)[1]
    signature, table = section.split("```")[1], section.split("```")[2].split("\n## ")[0]
    doc = ast.parse("def f" + signature.strip().removeprefix("CacheManager") + ": pass").body[0]
    documented = {a.arg: a for a in doc.args.args + doc.args.kwonlyargs}
    real = inspect.signature(CacheManager.__init__).parameters
    assert list(documented) == constructor_arguments(), (
        "docs/api.md's CacheManager signature differs from the class's arguments"
    )
    defaults = dict(zip([a.arg for a in doc.args.args][::-1], doc.args.defaults[::-1]))
    defaults.update({a.arg: d for a, d in zip(doc.args.kwonlyargs, doc.args.kw_defaults) if d})
    for name, default in defaults.items():
        assert ast.literal_eval(default) == real[name].default, f"{name}'s default in docs/api.md"
    for name in constructor_arguments():
        assert f"`{name}`" in table, f"docs/api.md's argument table lacks {name}"


DOC_NAME = re.compile(r"(?<![\w/.-])((?:\.\./)?(?:docs/)?[A-Za-z_][\w-]*\.md)\b")


def tracked_files():
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [f for f in out.splitlines() if f.endswith((".py", ".md", ".cc", ".h", ".cu", ".sh"))]


def test_no_file_names_a_document_the_repository_lacks():
    """A `name.md` is found beside the file naming it, in docs/ or at the
    top; the project contract's old name ("SPEC") and notes kept outside the
    repository are named nowhere."""
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} | {p.name for p in ROOT.glob("*.md")}
    missing = []
    for name in tracked_files():
        path = ROOT / name
        if not path.is_file() or path == pathlib.Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        for ref in DOC_NAME.findall(text):
            base = ref.rsplit("/", 1)[-1]
            if base not in docs and not (path.parent / ref).exists():
                missing.append(f"{name}: {ref}")
        for word in ("SPEC", "shared/notes"):
            if re.search(rf"\b{re.escape(word)}\b", text):
                missing.append(f"{name}: {word}")
    assert not missing, "documents named but not in the repository:\n" + "\n".join(missing)


def test_the_concept_table_names_test_folders_and_files_that_exist():
    """architecture.md's "tests" column: every folder and test file it names
    is there (a move or a rename updates it)."""
    tests = ROOT / "tests" / "python"
    table = ARCHITECTURE.split("## Where each concept lives", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    assert rows and all(line.count("|") == 5 for line in rows), "the table has four columns"
    names = [line.rsplit("|", 2)[1] for line in rows]
    missing = []
    for cell in names:
        for token in re.findall(r"`([\w/]+)`", cell):
            if token.startswith("tests/"):
                ok = (ROOT / token).exists()
            elif token.endswith("/"):
                ok = (tests / token).is_dir()
            else:
                ok = any(tests.rglob(f"{pathlib.PurePosixPath(token).name}.py"))
                if "/" in token:
                    ok = (tests / f"{token}.py").exists()
            if not ok:
                missing.append(token)
    assert not missing, f"architecture.md's tests column names what is not there: {missing}"
