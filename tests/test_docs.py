"""The documentation's shape: every page in the navigation, every public name on an
API page, a README that opens with the set-up commands, the site checker
(`docs/check_site.py`) on small pages, and the benchmark tables' headers on the
performance page. (Sybil runs the pages' code blocks, conftest.py at the root;
`mkdocs build --strict` and the checker run in CI.)"""

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

import eqshard
import eqshard.testing

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def _module(path: Path) -> ModuleType:
    """A script of the repository (not a package) loaded as a module, by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_site = _module(DOCS / "check_site.py")
report = _module(ROOT / "benchmarks" / "report.py")


def _nav() -> str:
    """mkdocs.yml's `nav` section, up to the next blank line (read without a YAML parser)."""
    return (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1].split("\n\n", 1)[0]


def test_the_navigation_lists_every_page_once():
    nav = re.findall(r":\s+(\S+\.md)\s*$", _nav(), flags=re.MULTILINE)
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert len(nav) == len(set(nav)), nav
    assert sorted(nav) == pages


def test_the_navigation_is_grouped_as_equinoxs():
    groups = re.findall(r"^  - ([^:]+):", _nav(), re.MULTILINE)
    assert groups == ["Getting started", "Guides", "Examples", "API", "Misc"]
    guides = _nav().split("  - Guides:\n", 1)[1].split("\n  - ", 1)[0]
    titles = re.findall(r"^      - ([^:]+):", guides, re.MULTILINE)
    assert titles[0] == "Suggest and diff"  # where a newcomer looks first
    assert {"The expression language", "Spec files and the schema", "Cost and targets"} <= set(
        titles
    )
    assert "suggest-and-diff.md" in (DOCS / "index.md").read_text()


def test_every_public_name_is_on_an_api_page():
    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^::: (\S+)$", page.read_text(), re.MULTILINE))
    public = {f"eqshard.{name}" for name in eqshard.__all__}
    for namespace in eqshard._NAMESPACES:
        module = getattr(eqshard, namespace)
        public |= {f"eqshard.{namespace}.{name}" for name in module.__all__}
    assert sorted(public - documented) == []
    assert sorted(documented - public - {"eqshard.testing"}) == []  # nothing private


def test_the_readme_is_short_and_opens_with_the_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    first_block = re.search(r"^```bash\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
    assert first_block is not None
    assert first_block.group(1).splitlines() == [
        "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/eqshard demo",
        "python3 -m venv .venv && .venv/bin/pip install '.[test]' && .venv/bin/python -m pytest -n auto",
    ]
    assert readme.index("## In ten lines") < readme.index("## What eqshard does")


def test_the_readmes_links_into_the_docs_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]*)", readme)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []


# The site checker, on pages small enough to read: each rule once broken, once kept.


def _rules(html: str, width: int = 100) -> list[str]:
    return [fault.rule for fault in check_site.check_html(html, "page.html", width)]


@pytest.mark.parametrize(
    "paragraph",
    ["- a list item", "* a list item", "1. a list item", "  - after white space", "+ plus"],
)
def test_the_checker_finds_a_list_rendered_as_text(paragraph):
    assert _rules(f"<p>{paragraph}</p>") == ["a list rendered as text"]


@pytest.mark.parametrize(
    "html",
    [
        "<ul><li>a list item</li></ul>",
        "<p>A sentence - with a dash.</p>",
        "<p>-1 is a number, and 2.5 is too.</p>",
        "<p><code>- x</code> is inline code</p>",  # the text starts with code
        "<pre><code>- a diff line\n1. an output line</code></pre>",
    ],
)
def test_the_checker_leaves_lists_and_text_alone(html):
    assert not [rule for rule in _rules(html) if "list" in rule]


def test_the_checker_measures_code_lines_against_the_column():
    narrow = '<div class="highlight"><pre><span></span><code>' + "x" * 100 + "\n</code></pre></div>"
    wide = narrow.replace("x" * 100, "x" * 60 + '<span class="n">' + "y" * 41 + "</span>")
    assert _rules(narrow) == []
    (rule,) = _rules(wide)
    assert rule.startswith("a code line of 101 characters, wider than the column (100)")
    assert _rules(wide, width=101) == []
    assert check_site.display_width("表") == 2  # wide characters take two columns
    assert check_site.display_width("┃ ─ │") == 5


def test_a_wide_block_must_say_why_and_is_listed():
    block = "<pre><code>" + "z" * 150 + "</code></pre>"
    faults, wide = check_site.check_page(f'<!-- wide: "a real tool\'s output" -->\n{block}', "p")
    assert faults == []
    assert [(w.widest, w.why) for w in wide] == [(150, "a real tool's output")]
    # a comment that does not stand right before the block exempts nothing
    faults, wide = check_site.check_page(f"<!-- wide: why -->\n<p>Text.</p>\n{block}", "p")
    assert len(faults) == 1
    assert wide == []


def _signature(kind: str, text: str) -> str:
    return (
        f'<h2><code class="doc-symbol doc-symbol-heading doc-symbol-{kind}"></code></h2>'
        f'<div class="doc-signature highlight"><pre><span></span><code>{text}</code></pre></div>'
    )


@pytest.mark.parametrize(
    ("kind", "text", "missing"),
    [
        ("function", "apply(model: PyTree, spec: Spec = FROM_FIELDS) -&gt; PyTree", []),
        ("function", "apply(\n    model: PyTree,\n    *,\n    devices: int = 8,\n) -&gt; Any", []),
        ("method", "lower(self, *args: Any, **kwargs: Any) -&gt; Lowered", []),
        ("class", "Rules(rules: list[Rule], default: str = 'replicate')", []),
        ("attribute", "Devices = Union[int, None]", []),  # a type alias: no signature to type
        ("function", "apply(model, spec=FROM_FIELDS)", ["model", "spec", "the return value"]),
        ("method", "lower(*args, **kwargs) -&gt; Lowered", ["args", "kwargs"]),
        ("function", "field(expr: str)", ["the return value"]),
        ("class", "Rules(rules, default: str = 'x')", ["rules"]),
    ],
)
def test_the_checker_finds_untyped_signatures(kind, text, missing):
    faults = check_site.check_html(_signature(kind, text), "api.html")
    assert [f.text for f in faults] == [
        what if what == "the return value" else f"parameter `{what}`" for what in missing
    ]
    assert all(f.rule.startswith(f"an API signature ({kind})") for f in faults)


def test_the_checker_exits_1_naming_the_file_and_the_text(tmp_path, capsys):
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "index.html").write_text("<p>Fine.</p><ul><li>item</li></ul>")
    assert check_site.main([str(tmp_path / "good")]) == 0
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "index.html").write_text("<p>Fine.</p>\n<p>- a list as text</p>")
    assert check_site.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "bad/index.html:2: a list rendered as text: - a list as text" in out
    assert check_site.main([str(tmp_path / "nowhere")]) == 2


# The performance page: every table is written by benchmarks/report.py, headed by its run.


def test_the_report_blocks_are_well_formed_and_name_their_runs():
    blocks = {name: block.page for run in report.RUNS for name, block in run.blocks.items()}
    for page in sorted(set(blocks.values())):
        text = (ROOT / page).read_text()
        names = report.blocks_of(text)  # raises on markers that are not well formed
        assert sorted(names) == sorted(n for n, p in blocks.items() if p == page), page
        for found in report.MARKER.finditer(text):
            body = found["body"]
            run = re.match(r"Run: `(?P<command>[^`]+)` on (?P<rest>.+?)\n", body)
            assert run is not None, f"{page}: report:{found['name']} does not open with its run"
            assert re.search(r"\bpython benchmarks/bench_\w+\.py\b", run["command"])
            rest = run["rest"]
            for package in ("Python", "jax", "jaxlib", "equinox", "libtpu"):
                assert re.search(rf"\b{package} (\d|not installed)", rest), (found["name"], package)
            assert re.search(r"\d+ cores?\b", rest)
            assert re.search(r"\d{4}-\d\d-\d\d", rest)
            assert "|" in body or "```" in body, f"report:{found['name']} holds no table"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- report:a -->\n<!-- report:b -->\n<!-- /report -->\n", "report:b opens inside a"),
        ("<!-- report:a -->\nnever closed\n", "report:a is not closed"),
        ("<!-- /report -->\n", "closes no block"),
        ("<!-- report:a -->\n<!-- /report -->\n" * 2, "report:a is used twice"),
    ],
)
def test_bad_report_markers_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        report.blocks_of(text)
