"""The spec-file schema's patterns are portable ECMA-262 regexes (the dialect of JSON
Schema), which Python's `re` reads the same way, and they accept exactly what eqshard's
parsers accept: an editor's schema check agrees with `eqshard validate`.

They use no class escape (`\\s`, `\\d`, `\\w`: ECMA-262's and Python's differ beyond
ASCII) and no Unicode property (`re` has none). Letters are listed: the one class of
`$defs/characters`, every code point of Unicode's general category L and `_`, written
as themselves; white space is Python's `str.isspace`, as `\\x..` and `\\u....`
escapes. The patterns end `$(?!\\n)`: in ECMA-262 `$` is the end of the text, and
Python's `$` also matches before a final newline, which the lookahead refuses.

The patterns are made here: `python tests/test_schema_patterns.py` writes them into
`schemas/eqshard.schema.json` (the package's copy is a link to it).
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import sys
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

import eqshard
from eqshard._expression import is_name_char, name_text

SCHEMA = Path(__file__).parent.parent / "schemas" / "eqshard.schema.json"
END = r"$(?!\n)"


def _ranges(keep: Callable[[str], bool]) -> list[tuple[int, int]]:
    """The runs of code points that `keep` keeps, surrogates left out."""
    runs: list[tuple[int, int]] = []
    for point in itertools.chain(range(0xD800), range(0xE000, 0x110000)):
        if keep(chr(point)):
            if runs and runs[-1][1] == point - 1:
                runs[-1] = (runs[-1][0], point)
            else:
                runs.append((point, point))
    return runs


def _class_body(keep: Callable[[str], bool], write: Callable[[int], str]) -> str:
    return "".join(
        write(a) + ("" if a == b else ("" if b == a + 1 else "-") + write(b))
        for a, b in _ranges(keep)
    )


def _escape(point: int) -> str:
    return f"\\x{point:02x}" if point < 0x100 else f"\\u{point:04x}"


LETTERS = _class_body(is_name_char, chr)  # the letters as themselves, and '_'
WHITE_SPACE = _class_body(str.isspace, _escape)
NAME_CHAR = rf"[^0-9{WHITE_SPACE}*.>\-()']"  # in a text of `characters`: a letter or '_'
SPACE = f"[{WHITE_SPACE}]"


def patterns() -> dict[str, str]:
    """Each `$defs` entry's pattern, as this Python's Unicode data makes it."""
    quoted = rf"'(?!_[0-9]+')[^0-9{WHITE_SPACE}*.>\-()'][^{WHITE_SPACE}*>()']*'"
    name = rf"(?:{NAME_CHAR}+|{quoted})"
    element = rf"(?:{name}(?:[1-9][0-9]*)?\*?|[1-9][0-9]*\*?|\*|\.\.\.)"
    group = rf"\({SPACE}*{name}(?:{SPACE}+{name})*{SPACE}*\)"
    logical = rf"{NAME_CHAR}[^{WHITE_SPACE}*>()']*"  # then letters, '_', digits, '-', '.'
    left = rf"(?:{logical}|\.\.\.)"
    left_or_group = rf"(?:{name}|\.\.\.|{group})"
    return {
        "characters": rf"^[{LETTERS}0-9{WHITE_SPACE}*.>\-()']*{END}",
        "name": f"^{NAME_CHAR}+{END}",
        "logical_name": f"^{logical}{END}",
        "expression": (
            rf"^{SPACE}*(?:{left_or_group}(?:{SPACE}+{left_or_group})*{SPACE}*->{SPACE}*)?"
            rf"{element}(?:{SPACE}+{element})*{SPACE}*{END}"
        ),
        "named_dims": rf"^{SPACE}*{left}(?:{SPACE}+{left})*{SPACE}*{END}",
        "path": _path_pattern(),
    }


def _path_pattern() -> str:
    """The rule-path pattern: segments, globs, alternatives and quoted keys."""
    q = '"'  # a quote as itself: ECMA-262's Unicode mode has no escape \"
    plain = rf"[^.*{WHITE_SPACE}\[\]'{q}{{}}]"
    alternative = rf"[^.*{WHITE_SPACE}\[\]'{q}{{}},]"
    escape = rf"\\(?:[\\'{q}nrt]|x[0-9a-fA-F]{{2}}|u[0-9a-fA-F]{{4}}|U(?:000[0-9a-fA-F]|0010)[0-9a-fA-F]{{4}})"
    quoted = rf"\[(?:'(?:[^'\\]|{escape})*'|{q}(?:[^{q}\\]|{escape})*{q})\]"
    segment = (
        rf"\*\*|\*|\*?(?:{plain}+\*)*{plain}+|\*?(?:{plain}+\*)+"
        rf"|\{{{alternative}+(?:,{alternative}+)*\}}"
    )
    return rf"^(?:{segment}|{quoted})(?:\.(?:{segment})|{quoted})*{END}"


def _unicode_of(schema: dict[str, Any]) -> str | None:
    """The Unicode version of the schema's letters."""
    comment = schema["$defs"].get("characters", {}).get("$comment", "")
    found = re.search(r"Unicode ([0-9.]+[0-9])", comment)
    return found and found.group(1)


def write() -> None:
    """Writes the patterns, and the Unicode version of its letters, into the schema."""
    schema = json.loads(SCHEMA.read_text("utf-8"))
    for name, pattern in patterns().items():
        schema["$defs"][name]["pattern"] = pattern
    schema["$defs"]["characters"]["$comment"] = (
        f"Letters of Unicode {unicodedata.unidata_version}: written by "
        "`python tests/test_schema_patterns.py`"
    )
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n", "utf-8")


# --------------------------------------------------------------------------- #
# The patterns are the ones made here, and each is the parser's.
# --------------------------------------------------------------------------- #

_SCHEMA = eqshard.schema()
_VALIDATOR = Draft202012Validator(_SCHEMA)
_SAME_UNICODE = _unicode_of(_SCHEMA) == unicodedata.unidata_version


def test_the_schema_holds_the_patterns_made_here():
    made = patterns()
    found = {name: _SCHEMA["$defs"][name]["pattern"] for name in made}
    if not _SAME_UNICODE:  # the letters are another Unicode's: the rest is the same
        made.pop("characters")
        found.pop("characters")
    assert found == made, "run `python tests/test_schema_patterns.py` to write them"


def test_no_pattern_uses_a_class_escape_or_a_unicode_property():
    for name, pattern in _every_pattern(_SCHEMA):
        unescaped = re.sub(r"\\\\", "", pattern)
        assert not re.search(r"\\[sSdDwWpPbB]", unescaped), name


def _every_pattern(node: Any, at: str = "$") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield at, value
            else:
                yield from _every_pattern(value, f"{at}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _every_pattern(value, f"{at}[{i}]")


@pytest.mark.skipif(not _SAME_UNICODE, reason="the schema's letters are another Unicode's")
def test_the_characters_are_the_parsers_letters_digits_white_space_and_signs():
    """Every code point: in `characters` exactly where the parser takes it."""
    pattern = re.compile(_SCHEMA["$defs"]["characters"]["pattern"])
    for a, b in _ranges(lambda c: True):
        for point in range(a, b + 1):
            c = chr(point)
            takes = is_name_char(c) or "0" <= c <= "9" or c.isspace() or c in "*.>-()'"
            assert (pattern.search(c) is not None) is takes, hex(point)


# A name, dims by name and an expression: each as the schema judges it in a spec file
# and as the parser does.
NAMES = [
    "a", "data", "Model", "_x", "_", "x_1", "é", "e\u0301", "ω", "日本", "ǅ", "ʰ", "ª",
    "\U0001d465", "\U00010400", "ⅷ", "a²", "x1", "1", "٣", "-", "a-b", "a.b", "a*", "",
    "a\n", "\na", "a b", "a\u200b", "a\ufeff", "a\x1c", "a\x85", "a\xa0", "a\u2028",
    "a$", "$",
]  # fmt: skip
EXPRESSIONS = [
    "a b -> a b*", "x -> x2*", "... -> * ...", "o i* ", "é ω -> é* ω", "a->a*",
    "ⅷ -> ⅷ*", "a² -> a²", "a -> a٣", "a -> a*\n", "a\x1c->\x1ca*", "a\x85-> a*",
    "a\ufeff-> a*", "a\u2028->\u2028a*", "a -> a0", "a -> a 2 3*", "a b -> a $",
    "\U0001d465 -> \U0001d465*", "a - > a", "a -> a**", "a -> .. a",
    "(a b) c -> a2 c b4", "( a b ) -> a2 b4", "(a) -> a2", "(a b)c -> a b c",
    "c(a b) -> a b c", "() -> a", "(a (b c)) -> a b c", "(a ...) -> a ...",
    "a b -> (a b)", "(é ω) -> ω* é", "(a\x1cb) -> a b",
    "'dim1' 'row-alias' -> 'dim1'2 'row-alias'4*", "'a.b' -> 'a.b'", "'1a' -> '1a'",
    "'_0' -> '_0'", "'_0a' -> '_0a'", "'' -> a", "'a b' -> a", "'a/b' -> 'a/b'",
    "('x0' 'x1') -> 'x1'2 'x0'4", "'a*' -> a", "'a -> a", "'é-1' -> 'é-1'2",
]  # fmt: skip
NAMED = [
    "... hidden embed", "hidden embed", "_ _ x", "é ω", "ⅷ", "a² b", "x1", " a ",
    "a\n", "a\ufeff", "a\x1c b", "", "... ...x", "a-b",
]  # fmt: skip


def _name_parses(text: str) -> bool:
    try:
        return eqshard.expression.parse(f"{text} -> {text}").lhs == (text,)
    except eqshard.ExpressionError:
        return False


def _logical_parses(text: str) -> bool:
    """A logical name (a dim of `dims`) as the parser takes it, quoted where it must be."""
    try:
        return eqshard.expression.parse(f"{name_text(text)} -> {name_text(text)}").lhs == (text,)
    except eqshard.ExpressionError:
        return False


def _expression_parses(text: str) -> bool:
    try:
        eqshard.expression.parse(text)
    except eqshard.ExpressionError:
        return False
    return True


def _named_parses(text: str) -> bool:
    from eqshard._specfile._model import Named

    try:
        Named(text)
    except eqshard.ExpressionError:
        return False
    return True


def _valid(document: dict[str, Any]) -> bool:
    return not list(_VALIDATOR.iter_errors(document))


def _loads(document: dict[str, Any]) -> bool:
    try:
        eqshard.load(document)
    except eqshard.SpecError:
        return False
    return True


CASES: list[tuple[str, str, Callable[[str], bool], Callable[[str], dict[str, Any]]]] = [
    *[("mesh axis", n, _name_parses, lambda n: {"eqshard": 1, "mesh": [[n, 2]]}) for n in NAMES],
    *[("dim name", n, _logical_parses, lambda n: {"eqshard": 1, "dims": {n: "*"}}) for n in NAMES],
    *[
        ("logical axis", n, _name_parses, lambda n: {"eqshard": 1, "dims": {"x": n}})
        for n in NAMES
        if not re.fullmatch(r"[1-9][0-9]*\*?|\*", n)  # a shard modifier, not a name
    ],
    *[
        ("expression", e, _expression_parses, lambda e: {"eqshard": 1, "rules": [{"path": "w", "expr": e}]})
        for e in EXPRESSIONS
    ],
    *[
        ("dims by name", d, _named_parses, lambda d: {"eqshard": 1, "rules": [{"path": "w", "dims": d}]})
        for d in NAMED
    ],
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "text", "parses", "document"), CASES, ids=[f"{c[0]}-{c[1]!r}" for c in CASES]
)
def test_the_schema_and_the_parser_agree(kind, text, parses, document):
    del kind
    assert _valid(document(text)) is parses(text)


@pytest.mark.parametrize("name", NAMES)
def test_validate_takes_a_mesh_axis_name_as_the_schema_does(name):
    document = {"eqshard": 1, "mesh": [[name, 2]]}
    assert _loads(document) is _valid(document)


@pytest.mark.parametrize("name", ["ⅷ", "a²", "a b", "x1"])
def test_a_mesh_axis_name_that_is_no_name_is_said_so_without_the_pattern(name):
    with pytest.raises(eqshard.SpecError) as caught:
        eqshard.load({"eqshard": 1, "mesh": [[name, 2]]})
    (line,) = str(caught.value).splitlines()[1:]
    assert (
        line
        == f"  <mapping>::$.mesh[0][0]: {name!r} is not a mesh axis name: write letters and '_'"
    )


def test_the_table_holds_what_the_old_patterns_got_wrong():
    """`[^\\W\\d]` took `ⅷ` and `a²` (numbers that are not decimal digits), and in
    ECMA-262 it is ASCII only; `\\s` takes U+001C and U+0085 in Python, U+FEFF in
    ECMA-262. The parser takes names of letters and '_', and Python's white space."""
    assert not _name_parses("ⅷ")
    assert not _name_parses("a²")
    assert _name_parses("é")
    assert _name_parses("\U0001d465")
    assert _expression_parses("a\x1c->\x1ca*")
    assert not _expression_parses("a\ufeff-> a*")


# --------------------------------------------------------------------------- #
# Another regex engine: node's (V8), as a JSON Schema validator in JavaScript, or an
# editor, runs the patterns (`new RegExp(pattern, "u")`).
# --------------------------------------------------------------------------- #

_NODE = shutil.which("node")
_RUN = r"""
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const out = {verdicts: [], scans: []};
for (const [pattern, texts] of input.tests) {
  const re = new RegExp(pattern, "u");
  out.verdicts.push(texts.map((t) => re.test(t)));
}
for (const pattern of input.scans) {  // the runs of code points the pattern takes alone
  const re = new RegExp(pattern, "u");
  const runs = [];
  for (let p = 0; p < 0x110000; p++) {
    if (p >= 0xd800 && p <= 0xdfff) continue;
    if (!re.test(String.fromCodePoint(p))) continue;
    if (runs.length && runs[runs.length - 1][1] === p - 1) runs[runs.length - 1][1] = p;
    else runs.push([p, p]);
  }
  out.scans.push(runs);
}
process.stdout.write(JSON.stringify(out));
"""


def _node(tests: list[tuple[str, list[str]]], scans: list[str]) -> dict[str, Any]:
    assert _NODE is not None
    found = subprocess.run(
        [_NODE, "-e", _RUN],
        input=json.dumps({"tests": tests, "scans": scans}),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(found.stdout)


_DEFS = {"mesh axis": "name", "dim name": "logical_name", "logical axis": "name"}
_DEFS |= {"expression": "expression", "dims by name": "named_dims"}


@pytest.mark.skipif(_NODE is None, reason="node is not installed")
def test_node_judges_every_pattern_as_python_does():
    """Each pattern on every text of the table, and the classes on every code point:
    V8's verdicts are Python's `re`'s, which are the parser's."""
    defs = _SCHEMA["$defs"]
    tests: list[tuple[str, list[str]]] = []
    for kind, name in _DEFS.items():
        texts = [text for k, text, _, _ in CASES if k == kind]
        tests += [(defs[name]["pattern"], texts), (defs["characters"]["pattern"], texts)]
    paths = ["a.b", "**.*_proj.w", "a['b c']", "{0,2}.w", "a\n", "a\x1c", "a\ufeff", "a b"]
    tests.append((defs["path"]["pattern"], paths))
    tests.append((defs["modifier"]["pattern"], ["2", "2*", "*", "02", "2\n", "٣"]))
    scans = [
        defs["characters"]["pattern"],
        f"^{SPACE}{END}",
        f"^{NAME_CHAR}{END}",
    ]
    found = _node(tests, scans)
    for (pattern, texts), verdicts in zip(tests, found["verdicts"]):
        python = [re.search(pattern, text) is not None for text in texts]
        assert verdicts == python, [t for t, a, b in zip(texts, verdicts, python) if a != b]
    for pattern, runs in zip(scans, found["scans"]):
        python = _ranges(lambda c, p=re.compile(pattern): p.search(c) is not None)
        assert [tuple(run) for run in runs] == python, pattern
    for kind, name in _DEFS.items():  # and both are the parser's
        for k, text, parses, _ in CASES:
            if k == kind:
                both = [re.search(defs[n]["pattern"], text) for n in (name, "characters")]
                assert all(both) is parses(text), (kind, text)


if __name__ == "__main__":
    write()
    sys.exit(0)
