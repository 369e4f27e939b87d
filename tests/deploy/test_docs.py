"""The operator docs (docs/) name only options, files and commands that exist."""

import re

import pytest

from tests.deploy.metric_names import REPO_ROOT, exported_series

DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))


def _source_text() -> str:
    files = [*(REPO_ROOT / "controlplane").rglob("*.py"), *(REPO_ROOT / "worker").rglob("*.py")]
    return "\n".join(path.read_text() for path in files)


@pytest.fixture(scope="module")
def source() -> str:
    return _source_text()


def test_the_docs_are_there():
    assert {path.name for path in DOCS} >= {"gpu-node.md", "fleet.md", "upgrading.md"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_strata_variable_a_doc_names_is_read_by_the_code(doc, source):
    from worker.dataplane.config import describe_options

    options = {row["variable"] for row in describe_options()}
    for variable in set(re.findall(r"\bSTRATA_[A-Z0-9_]+\b", doc.read_text())):
        assert variable in options or f'"{variable}"' in source, f"{doc.name} names {variable}, which nothing reads"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_path_a_doc_names_exists(doc):
    text = doc.read_text()
    paths = set(re.findall(r"`((?:controlplane|worker|deploy|tests|docs)/[\w./-]+)`", text))
    paths |= set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)", text))
    assert paths or doc.name == "fleet.md"
    for path in paths:
        target = REPO_ROOT / path if "/" in path else doc.parent / path
        assert target.exists(), f"{doc.name} names {path}, which does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_metric_a_doc_names_is_exported(doc):
    exported = exported_series()
    for name in set(re.findall(r"\bstrata_[a-z0-9_]+_(?:total|bytes|seconds)\b", doc.read_text())):
        assert name in exported, f"{doc.name} names {name}, which no code exports"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_strata_command_a_doc_names_exists(doc):
    from controlplane.cli import COMMANDS

    for command in set(re.findall(r"`strata ([a-z-]+)", doc.read_text())):
        assert command in COMMANDS, f"{doc.name} names `strata {command}`"


def test_the_architecture_names_only_paths_and_functions_that_exist():
    """docs/architecture.md is written from the code: every file or folder it names in backticks
    exists, and every function it names is defined in a module it names."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w./-]+)`", text))
    # a URL (`/metrics`) is not a path of the tree
    paths = {n for n in named if not n.startswith("/") and ("/" in n or re.search(r"\.(py|toml|md)$", n))}
    assert len(paths) >= 30
    for path in paths:
        if "/" in path.rstrip("/"):
            assert (REPO_ROOT / path).exists(), f"architecture.md names {path}, which does not exist"
        else:  # a room's file (`models.py`): at the root, or in some app
            found = (REPO_ROOT / path).exists() or any((REPO_ROOT / "controlplane").glob(f"*/{path.rstrip('/')}"))
            assert found, f"architecture.md names {path}, which no app has"
    modules = "\n".join((REPO_ROOT / p).read_text() for p in paths if p.endswith(".py") and "/" in p)
    for function in {name for name in named if re.fullmatch(r"[a-z]+(?:_[a-z]+)+", name)}:
        assert re.search(rf"\bdef {function}\b", modules), f"architecture.md names {function}, defined nowhere it names"
