"""The documentation's shape: every page in the navigation, every public name on an
API page, and a README that opens with the set-up commands. (Sybil runs the pages'
code blocks, conftest.py at the root; `mkdocs build --strict` runs in CI.)"""

import re
from pathlib import Path

import eqshard
import eqshard.testing

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def _nav() -> str:
    """mkdocs.yml's `nav` section, up to the next blank line (read without a YAML parser)."""
    return (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].split("\n\n", 1)[0]


def test_the_navigation_lists_every_page_once():
    nav = re.findall(r":\s+(\S+\.md)\s*$", _nav(), flags=re.MULTILINE)
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert len(nav) == len(set(nav)), nav
    assert sorted(nav) == pages


def test_the_navigation_follows_a_users_order():
    titles = re.findall(r"^  - ([^:]+):", _nav(), re.MULTILINE)
    assert titles[:14] == [
        "Getting started",
        "The expression language",
        "Annotations and spec trees",
        "Spec files and the schema",
        "Meshes and logical axes",
        "Activations, optimizer state and host memory",
        "Init and checkpoints",
        "Multi-host",
        "The command line, CI and pre-commit",
        "Testing specs",
        "Cost and targets",
        "Suggest and diff",
        "Performance",
        "Compared with the alternatives",
    ]


def test_every_public_name_is_on_an_api_page():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (\S+)$", page.read_text(), re.MULTILINE))
    public = {f"eqshard.{name}" for name in eqshard.__all__}
    public |= {f"eqshard.testing.{name}" for name in eqshard.testing.__all__}
    assert sorted(public - documented) == []
    assert sorted(documented - public - {"eqshard.testing"}) == []  # nothing private


def test_the_readme_is_short_and_opens_with_the_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    first_block = re.search(r"^```bash\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
    assert first_block is not None
    assert first_block.group(1).splitlines() == [
        "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/eqshard demo",
        "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/python -m pytest",
    ]
    assert readme.index("## In ten lines") < readme.index("## What eqshard does")


def test_the_readmes_links_into_the_docs_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]*)", readme)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []
