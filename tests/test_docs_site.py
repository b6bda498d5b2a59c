"""The documentation site stays whole: every public name has its reference entry, every page is in the nav.

The strict build itself (``make docs``, run by ``make test``) fails on a broken link, a missing page or an
API reference that no longer resolves; these checks catch what a build cannot see: a public name nobody
documented, a page written but left out of the nav."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import safepoint
from tests.conftest import REPO

DOCS = REPO / "docs"


def _nav_pages() -> set[str]:
    text = (REPO / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w/.-]+\.md)\s*$", nav, re.M))


def test_every_public_name_is_in_the_api_reference() -> None:
    reference = (DOCS / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: safepoint\.(\w+)$", reference, re.M))
    public = set(safepoint.__all__) - {"__version__"}
    assert public - documented == set(), "add them to docs/reference/api.md"
    assert documented - public == set(), "docs/reference/api.md documents names that are not public"


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    nav = _nav_pages()
    assert nav - pages == set(), "mkdocs.yml names pages that do not exist"
    assert pages - nav == set(), "pages missing from the nav in mkdocs.yml"


def test_make_test_builds_the_site_strictly() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test: .*\bdocs\b", makefile, re.M)
    assert "mkdocs build --strict" in makefile
    # --quiet drops mkdocs's warnings before strict mode counts them: the build then passes broken links.
    docs = re.search(r"^docs:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert docs is not None and "--quiet" not in docs.group(1) and " -q" not in docs.group(1)
    assert re.search(r"^strict: true$", (REPO / "mkdocs.yml").read_text(), re.M)


def test_the_getting_started_loop_runs_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Section 2 of docs/getting-started.md, as written: a fresh run saves steps 50..200 (3 kept); run
    again, it restores step 200 and trains nothing."""
    text = (DOCS / "getting-started.md").read_text()
    after = text[text.index("## 2. Checkpoint a loop") :]
    found = re.search(r"```python\n(.*?)```", after, re.S)
    assert found
    monkeypatch.chdir(tmp_path)
    first: dict[str, object] = {"__name__": "snippet"}
    exec(compile(found.group(1), "getting-started", "exec"), first)
    assert first["step"] == 200 and first["extra"] == {"tokens_seen": 1600}
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-100", "step-150", "step-200"]
    again: dict[str, object] = {"__name__": "snippet"}
    exec(compile(found.group(1), "getting-started", "exec"), again)
    assert again["step"] == 200 and again["extra"] == {"tokens_seen": 1600}  # restored, not retrained
