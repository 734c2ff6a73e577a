"""Path patterns: `*`, `**`, globs within a segment and quoted keys, `PathIndex`, and
`name`, the one name of a leaf, which reads back as a pattern for exactly that leaf."""

import random
import re
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
from hypothesis import given, settings, strategies as st
from jsonschema import Draft202012Validator

import eqshard
from eqshard import PathError
from eqshard._paths._closest import aligned, closest
from eqshard._paths._globs import readable_rules
from eqshard._paths._grammar import DEEP, parse, render
from eqshard._paths._match import PathIndex, match
from eqshard._paths._names import name


def _segs(path: str) -> tuple[str, ...]:
    return tuple(path.split(".")) if path else ()


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        # literals
        ("a.b.c", "a.b.c", True),
        ("a.b.c", "a.b", False),
        ("a.b", "a.b.c", False),
        ("a.b.c", "a.x.c", False),
        # `*`: exactly one whole segment
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.0.c", True),
        ("a.*.c", "a.c", False),
        ("a.*.c", "a.b.b.c", False),
        ("*", "a", True),
        ("*", "a.b", False),
        ("*.*", "a.b", True),
        # `**` at the start
        ("**.weight", "weight", True),  # zero segments
        ("**.weight", "blocks.0.up.weight", True),
        ("**.weight", "blocks.0.up.bias", False),
        ("**.weight", "weight.bias", False),
        # `**` in the middle
        ("blocks.**.weight", "blocks.weight", True),  # zero segments
        ("blocks.**.weight", "blocks.0.attn.weight", True),
        ("blocks.**.weight", "layers.0.weight", False),
        ("a.**.b.**.c", "a.b.c", True),
        ("a.**.b.**.c", "a.x.b.y.z.c", True),
        ("a.**.b.**.c", "a.x.y.c", False),
        ("a.**.b.b.**.c", "a.b.x.b.c", False),
        ("a.**.b.b.**.c", "a.b.x.b.b.c", True),
        # `**` at the end
        ("blocks.**", "blocks", True),  # zero segments
        ("blocks.**", "blocks.0.attn.weight", True),
        ("blocks.**", "layers.0", False),
        ("**", "", True),
        ("**", "a.b.c", True),
        ("**.**", "a", True),
        ("**.*", "", False),
        ("**.*.**", "a", True),
        ("**.mid.**", "mid", True),
        ("**.mid.**", "a.mid.b", True),
        ("**.mid.**", "a.midx.b", False),
        # a glob within a segment
        ("*_proj", "query_proj", True),
        ("*_proj", "_proj", True),
        ("*_proj", "proj", False),
        ("*_proj", "query_proj.weight", False),  # one segment, never across a dot
        ("**.*_proj.weight", "blocks.0.attn.query_proj.weight", True),
        ("**.*_proj.weight", "blocks.0.attn.query.weight", False),
        ("x*_n", "x_n", True),
        ("x*_n", "xab_n", True),
        ("x*_n", "xab_m", False),
        ("x*_n", "x_", False),
        ("x*x", "x", False),  # the prefix and suffix may not overlap
        ("x*x", "xx", True),
        ("layer*", "layers", True),
        ("layer*", "layer", True),
        ("layer*", "laye", False),
        ("layer*", "alayers", False),
        ("*layer*", "alayers", True),
        ("a*b*c", "abc", True),
        ("a*b*c", "axxbyyc", True),
        ("a*b*c", "acb", False),
        ("a*b*b", "ab", False),
        ("a*b*b", "abb", True),
        ("a*b*b", "abxb", True),
        ("blocks.*.attn.*_proj.*", "blocks.3.attn.key_proj.bias", True),
        ("blocks.*.attn.*_proj.*", "blocks.3.attn.key.bias", False),
    ],
)
def test_match(pattern: str, path: str, matches: bool) -> None:
    assert match(pattern, _segs(path)) is matches


@pytest.mark.parametrize(
    ("patterns", "path", "first", "every"),
    [
        ([], "a", None, []),
        (["**.bias", "blocks.*.*_proj.weight"], "blocks.0.query_proj.weight", 1, [1]),
        (["**", "a"], "a", 0, [0, 1]),
        (["a", "**"], "a", 0, [0, 1]),
        (["b", "**"], "a", 1, [1]),
        (["*_proj", "query_*", "*"], "query_proj", 0, [0, 1, 2]),
        (["query_*", "*_proj"], "query_proj", 0, [0, 1]),
        (["**.0.**", "**.0"], "0.x.0", 0, [0, 1]),  # a segment seen twice counts once
        (["**.w.**", "**.w"], "x.y", None, []),
        (["x*_3", "x*_13", "**.x*_1"], "a.xy_1", 2, [2]),
        # a quoted key is a literal anchor, and never a glob
        (["**['a*b']", "**.a*b"], "x.a*b", 0, [0, 1]),
        (["**['a*b']", "**.a*b"], "x.ab", 1, [1]),
        (["['*']", "*"], "*", 0, [0, 1]),
        (["['*']", "*"], "a", 1, [1]),
        (["w['a b'].*", "w.*.x"], "w.a b.x", 0, [0, 1]),
    ],
)
def test_path_index(patterns: list[str], path: str, first: int | None, every: list[int]) -> None:
    index = PathIndex(patterns)
    assert len(index) == len(patterns)
    assert index.first(_segs(path)) == first
    assert index.all(_segs(path)) == every


_PATH_PATTERN = re.compile(eqshard.schema()["$defs"]["path"]["pattern"])


@pytest.mark.parametrize(
    ("pattern", "valid"),
    [
        ("blocks.*.attn.query_proj.weight", True),
        ("**.up.weight", True),
        ("**.*_proj.weight", True),
        ("*", True),
        ("**", True),
        ("**.**", True),
        ("x*_n", True),
        ("layer*", True),
        ("*a*", True),
        ("a*b*c", True),
        ("0.1", True),
        ("a**b", False),  # `**` is a whole segment or nothing
        ("**a", False),
        ("a**", False),
        ("***", False),
        ("a..b", False),
        (".a", False),
        ("a.", False),
        ("", False),
        ("a b", False),
        ("*a b", False),
        ("a\n", False),
        ("a*\n", False),
        # quoted keys
        ("_weights['w[0,0] 16x0e,32x0e']", True),
        ("['']", True),
        ("['a']['b'].c", True),
        ("**['a b']", True),
        ("*_p['x']", True),
        ('a["it\'s"]', True),
        ("a['it\\'s']", True),
        ("['\\\\ \\n \\r \\t \\x1b \\u200f \\U0001f600 \\U0010ffff \\\"']", True),
        ("['a\nb']", True),  # raw characters inside quotes are themselves
        ("a.['b']", False),  # no '.' before a quoted key
        ("['a']b", False),
        ("['a'].", False),
        ("['a'", False),
        ("['a]", False),
        ("[a]", False),
        ("a[0]", False),
        ("['\\q']", False),
        ("['\\x4']", False),
        ("['\\U00110000']", False),
        ("['a'']", False),
        ("a]", False),
        ("it's", False),
        ('"', False),
    ],
)
def test_schema_path_pattern(pattern: str, valid: bool) -> None:
    assert (_PATH_PATTERN.search(pattern) is not None) is valid
    assert _parses(pattern) is valid  # the reader agrees


def _parses(text: str) -> bool:
    try:
        parse(text)
    except PathError:
        return False
    return True


@pytest.mark.parametrize(
    ("pattern", "parts"),
    [
        ("a.b", ("a", "b")),
        ("**.*_proj.*", (DEEP, ("", "_proj"), None)),
        ("_weights['w[0,0] 16x0e,32x0e']", ("_weights", "w[0,0] 16x0e,32x0e")),
        ("['*']['**']", ("*", "**")),  # quoted: always literal
        ("**['a.b'].w", (DEEP, "a.b", "w")),
        ("a[\"it's\"]['x\\'y']", ("a", "it's", "x'y")),
        ("['\\\\\\n\\r\\t\\x1b\\u200f\\U0001f600\\\"']", ('\\\n\r\t\x1b\u200f\U0001f600"',)),
        ("['\\ud800']", ("\ud800",)),  # repr writes a lone surrogate so
        ("['']['']", ("", "")),
        ("['0'].0", ("0", "0")),
    ],
)
def test_quoted_keys_read_back_as_literals(pattern: str, parts: tuple) -> None:
    assert parse(pattern) == parts


_QUOTE_IT = (
    "a key holding '.', '*', white space, a bracket or a quote is written quoted, as "
    "eqshard names it"
)


@pytest.mark.parametrize(
    ("pattern", "column", "length", "rule"),
    [
        ("", 0, 1, "an empty rule path; name a segment ('**' matches every leaf)"),
        (
            "_weights.w[0,0] 16x0e,32x0e",
            10,
            1,
            f"'[' opens a quoted key, ['...'] or [\"...\"]; {_QUOTE_IT}: "
            "_weights['w[0,0] 16x0e,32x0e']",
        ),
        ("blocks.my key.w", 9, 1, f"white space in a segment; {_QUOTE_IT}: blocks['my key'].w"),
        ("it's.w", 2, 1, f'"\'" in a segment; {_QUOTE_IT}: ["it\'s"].w'),
        (
            "a.b c.d e",
            3,
            1,
            f"white space in a segment; {_QUOTE_IT} (params['a b'].w, for instance)",
        ),
        (
            "layers[0].weight",
            6,
            3,
            "an index is a segment of its own, after a '.': layers.0.weight",
        ),
        (
            "a.['b']",
            1,
            1,
            "a quoted key follows the segment before it with no '.' between: write \"a['b']\"",
        ),
        ("['a']b", 5, 1, "after a quoted key comes '.', another quoted key, or the end"),
        (
            "a..b",
            2,
            1,
            "an empty segment: segments are separated by one '.'; an empty key is written ['']",
        ),
        (".a", 0, 1, "the path starts with '.'; drop it ('**.' matches any prefix)"),
        ("a.", 1, 1, "the path ends with '.'; drop it, or name a segment after it"),
        (
            "x.a**b",
            3,
            2,
            "'**' is a whole segment (any number of segments); in a glob each '*' stands "
            "alone, as in '*_proj'; a key holding '*' is written quoted: x['a**b']",
        ),
        ("a['b", 1, 3, 'the quoted key is not closed; end it with "\']"'),
        ("a['b'c", 5, 1, "a quoted key ends with \"']\"; put ']' right after the '"),
        (
            "a['b\\qc']",
            4,
            2,
            "'\\q' is not an escape of a quoted key; those are the escapes "
            "Python's repr writes: \\\\ \\' \\\" \\n \\r \\t \\xhh \\uhhhh \\Uhhhhhhhh",
        ),
        ("a['\\x4g']", 3, 3, "'\\x' takes 2 hex digits"),
        ("a['\\U00110000']", 3, 10, "U+110000 is past the last code point, U+10FFFF"),
    ],
)
def test_path_errors_point_at_the_column(pattern, column, length, rule):
    with pytest.raises(PathError) as info:
        parse(pattern)
    error = info.value
    assert (error.path, error.position, error.length, error.rule) == (
        pattern,
        column,
        length,
        rule,
    )
    assert str(error) == f"bad rule path:\n{error.picture}\n{rule}"
    assert error.picture.splitlines()[1] == " " * (4 + column) + "^" * length


def test_a_rule_and_a_spec_file_show_the_caret():
    with pytest.raises(PathError, match="white space in a segment"):
        eqshard.Rule("blocks.my key.w", eqshard.expression.parse("a -> a*"))
    with pytest.raises(eqshard.SpecError) as info:
        eqshard.load({"eqshard": 1, "rules": [{"path": "blocks.my key.w", "expr": "a -> a*"}]})
    (problem,) = info.value.problems
    assert problem.where == "<mapping>::$.rules[0].path"
    assert problem.message.startswith("white space in a segment")
    assert problem.detail == "    blocks.my key.w\n             ^"


# The reference: the definition, by plain recursion and a regex per glob; a quoted
# key (one of `_QUOTED`) is the literal it stands for.
def _reference(parts: Sequence[str], path: Sequence[str]) -> bool:
    if not parts:
        return not path
    part, rest = parts[0], parts[1:]
    if part == "**":
        return any(_reference(rest, path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    if part in _QUOTED:
        return path[0] == _QUOTED[part] and _reference(rest, path[1:])
    glob = ".*".join(re.escape(piece) for piece in part.split("*"))
    return re.fullmatch(glob, path[0], re.DOTALL) is not None and _reference(rest, path[1:])


def _joined(tokens: Sequence[str]) -> str:
    """Pattern segments as one pattern: a quoted key follows with no '.'."""
    text = ""
    for token in tokens:
        text += token if token.startswith("[") or not text else f".{token}"
    return text


_QUOTED = {"['a.b']": "a.b", "['*']": "*", "['**']": "**", '["\'"]': "'", "['']": "", "['a']": "a"}
_PATTERN_SEGMENTS = ["a", "b", "ab", "0", "*", "**", "a*", "*b", "a*b", "*a*", "b*a*b", *_QUOTED]
_PATH_SEGMENTS = ["a", "b", "ab", "ba", "aab", "abab", "0", "", "a.b", "*", "**", "'"]

tokens_ = st.lists(st.sampled_from(_PATTERN_SEGMENTS), min_size=1, max_size=6)
patterns_ = tokens_.map(_joined)
paths_ = st.lists(st.sampled_from(_PATH_SEGMENTS), max_size=7).map(tuple)


@settings(max_examples=300, deadline=None)
@given(tokens_, paths_)
def test_match_agrees_with_the_definition(tokens: list[str], path: tuple[str, ...]) -> None:
    assert match(_joined(tokens), path) is _reference(tokens, path)


@settings(max_examples=100, deadline=None)
@given(st.lists(patterns_, max_size=30), st.lists(paths_, min_size=1, max_size=10))
def test_path_index_agrees_with_brute_force(
    patterns: list[str], paths: list[tuple[str, ...]]
) -> None:
    index = PathIndex(patterns)
    for path in paths:
        every = [i for i, p in enumerate(patterns) if match(p, path)]
        assert index.first(path) == next(iter(every), None)
        assert index.all(path) == every


def test_path_index_agrees_with_brute_force_on_many_patterns() -> None:
    rng = random.Random(0)
    names = ["blocks", "attn", "mlp", "query_proj", "key_proj", "up", "weight", "bias", "0", "1"]
    globs = ["*_proj", "query_*", "*a*", "w*t", "b*", "*s", "x*_1"]
    choices = [*names, *globs, "*", "**", "**"]
    patterns = [".".join(rng.choice(choices) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    index = PathIndex(patterns)
    for _ in range(300):
        path = tuple(rng.choice(names) for _ in range(rng.randint(0, 7)))
        expected = next((i for i, p in enumerate(patterns) if match(p, path)), None)
        assert index.first(path) == expected


class _TooSlow(Exception):
    pass


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raises `_TooSlow` in the block after `seconds`: a regression fails, not hangs."""

    def alarm(signum: int, frame: object) -> None:
        raise _TooSlow(f"over {seconds} s: catastrophic backtracking?")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("*a*a*a*a*a*a*a*a*a*a*b", ("a" * 5000,), False),
        ("*a*a*a*a*a*a*a*a*a*a*", ("a" * 5000,), True),
        ("a*a*a*a*a*a*a*a*a*a*a*ab*b", ("a" * 5000 + "b",), False),
        ("*" + "*".join("ab" * 50) + "*c", ("ab" * 3000 + "c",), True),
        ("**.a.**.a.**.a.**.a.**.b", ("a",) * 400, False),
        ("**.a.**.a.**.a.**.a.**", ("a",) * 400, True),
        ("**.a.**.a.**.a.**.a.**.a.b.**", (("a",) * 400), False),
        (".".join(["**", "a"] * 30 + ["b"]), ("a",) * 2000, False),
        (".".join(["**", "*a*"] * 30 + ["**", "*y"]), ("xay",) * 2000, True),
        (".".join(["**", "a.b"] * 30), ("a",) * 1999 + ("b",), False),
    ],
)
def test_no_catastrophic_backtracking(pattern: str, path: tuple[str, ...], matches: bool) -> None:
    # A backtracking matcher would not finish these in the age of the universe; this
    # one takes milliseconds. A generous deadline stops a hang, never a slow machine.
    with _deadline(60.0):
        assert match(pattern, path) is matches
        assert PathIndex([pattern]).first(path) == (0 if matches else None)


LEAVES = [
    "embed.weight",
    "blocks.0.up.weight",
    "blocks.0.up.bias",
    "blocks.1.up.weight",
    "blocks.1.down.weight",
    "norm.weight",
]


@pytest.mark.parametrize(
    ("pattern", "path", "fixed"),
    [
        ("**.upp.weight", "blocks.0.up.weight", "**.up.weight"),
        ("blocks.*.qurey", "blocks.1.query", "blocks.*.query"),
        ("blocks.x.up", "blocks.1.up", "blocks.*.up"),  # a name where an index is
        ("**.*_prj.weight", "attn.query_proj.weight", "**.query_proj.weight"),
        ("blocks.**.attn.**.w", "blocks.1.attn.x.w", "blocks.**.attn.**.w"),
        ("blocks.**.attn.**.w", "blocks.1.x.w", None),  # `attn` is not in the path
        ("a.b.c", "a.b", None),
        ("**.a.b", "b", None),
    ],
)
def test_aligned_changes_only_what_does_not_match(pattern, path, fixed):
    assert aligned(pattern, _segs(path)) == fixed
    if fixed is not None:
        assert match(fixed, _segs(path))


@pytest.mark.parametrize(
    ("pattern", "best", "leaves"),
    [
        ("**.upp.weight", "**.up.weight", ["blocks.0.up.weight", "blocks.1.up.weight"]),
        ("**.up.weigth", "**.up.weight", ["blocks.0.up.weight", "blocks.1.up.weight"]),
        ("**.weights", "**.weight", [p for p in LEAVES if p.endswith("weight")]),
        ("embd.weight", "embed.weight", ["embed.weight"]),
        ("blocks.1.upp.weight", "blocks.1.up.weight", ["blocks.1.up.weight"]),
        (
            "blocks.0.mlp.up.weight",
            "blocks.0.up.weight",
            ["blocks.0.up.weight"],
        ),  # a level too many
        ("**.nowhere", None, []),
    ],
)
def test_closest_is_a_did_you_mean_that_matches_leaves(pattern, best, leaves):
    found = closest(pattern, [_segs(p) for p in LEAVES])
    if best is None:
        assert found == []
        return
    assert found[0] == (best, [LEAVES.index(p) for p in leaves])
    assert all(indices for _, indices in found)


def test_closest_tries_paths_that_differ_by_index_once():
    paths = [("layers", str(i), name, "weight") for i in range(3000) for name in ("attn", "mlp")]
    (best, indices), *_ = closest("layers.*.atn.weight", paths)
    assert best == "layers.*.attn.weight"
    assert indices == list(range(0, 6000, 2))
    (best, indices), *_ = closest("layers.7.atn.weight", paths)  # its index, kept
    assert (best, indices) == ("layers.7.attn.weight", [14])


# Pieces of rule paths, good and bad, glued at random: the schema's pattern (through
# jsonschema, as `eqshard validate` runs it) and the reader's parser must agree.
_PIECES = [
    "a", "0", "_w", "é", "😀", "*", "**", "*_p", ".", "[", "]", "'", '"', "\\", " ", "\n",
    "\x1b", "['a b']", '["it\'s"]', "['\\n']", "['\\x1b']", "['\\u200f']", "['\\U0001f600']",
    "['\\U00110000']", "['\\q']", "['\\x4']", "['", "']", '["', '"]', "[0]", "x", "u", "U",
]  # fmt: skip
_DOCUMENT = Draft202012Validator(eqshard.schema())


def _schema_allows(path: str) -> bool:
    document = {"eqshard": 1, "rules": [{"path": path, "expr": "a -> a*"}]}
    return not list(_DOCUMENT.iter_errors(document))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=0, max_size=8).map("".join))
def test_schema_and_reader_agree(text: str) -> None:
    assert _schema_allows(text) is _parses(text)
    try:
        eqshard.load({"eqshard": 1, "rules": [{"path": text, "expr": "a -> a*"}]})
        loads = True
    except eqshard.SpecError:
        loads = False
    assert loads is _parses(text)


@pytest.mark.parametrize(
    ("pattern", "leaves", "best"),
    [
        # a typo in a quoted key: the fix is quoted too
        ("_weights['w[0,0] 16x0e,32x0']", ["_weights|w[0,0] 16x0e,32x0e"], "_weights['w[0,0] 16x0e,32x0e']"),
        ("**['a  b']", ["x|a b", "y|a b"], "**['a b']"),
        ("w['a_b']", ["w|a b"], "w['a b']"),
    ],
)  # fmt: skip
def test_closest_writes_keys_as_leaves_are_named(pattern, leaves, best):
    paths = [tuple(leaf.split("|")) for leaf in leaves]
    found = closest(pattern, paths)
    assert found[0] == (best, list(range(len(paths))))
    assert aligned(pattern, paths[0]) in (best, None)


# --------------------------------------------------------------------------- #
# Alternatives: `layers.{0,2,4}.weight`.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("pattern", "parts", "written"),
    [
        ("layers.{0,2,4}.weight", ("layers", frozenset({"0", "2", "4"}), "weight"), None),
        ("layers.{10,2}.w", ("layers", frozenset({"2", "10"}), "w"), "layers.{2,10}.w"),
        ("**.{key_proj,query_proj}", (DEEP, frozenset({"key_proj", "query_proj"})), None),
        ("{a}['b c']", (frozenset({"a"}), "b c"), None),
        ("a.{1,x,0}", ("a", frozenset({"0", "1", "x"})), "a.{0,1,x}"),
    ],
)
def test_alternatives_parse_and_render(pattern: str, parts: tuple, written: str | None) -> None:
    assert parse(pattern) == parts
    assert render(parts) == (written or pattern)
    assert parse(render(parts)) == parts
    assert _PATH_PATTERN.search(pattern) is not None


def test_alternatives_match_any_one_of_them() -> None:
    assert match("layers.{0,2}.weight", ("layers", "2", "weight"))
    assert not match("layers.{0,2}.weight", ("layers", "1", "weight"))
    assert match("**.{up,down}.weight", ("blocks", "0", "down", "weight"))
    index = PathIndex(["layers.{1,3}.weight", "layers.*.weight"])
    assert index.first(("layers", "3", "weight")) == 0
    assert index.first(("layers", "2", "weight")) == 1
    assert name(("a{b}",)) == "['a{b}']"  # a key holding a brace is quoted
    assert parse("['a{b}']") == ("a{b}",)


@pytest.mark.parametrize(
    ("pattern", "column", "message"),
    [
        ("a.{0,2", 2, "the alternatives are not closed; end them with '}'"),
        ("a.{0,2}x", 7, "alternatives are a whole segment"),
        ("a.{}", 3, "an empty alternative"),
        ("a.{0,,2}", 5, "an empty alternative"),
        ("a.{0,*}", 5, "'*' in an alternative"),
        ("a.{0 ,1}", 4, "' ' in an alternative"),
        ("a{0}", 1, "'{' in a segment; alternatives are a whole segment"),
        ("a}", 1, "'}' in a segment"),
    ],
)
def test_malformed_alternatives_point_at_the_fault(pattern: str, column: int, message: str) -> None:
    with pytest.raises(PathError, match=re.escape(message)) as info:
        parse(pattern)
    assert info.value.position == column
    assert _PATH_PATTERN.search(pattern) is None


_BRACE_PIECES = ["a", "0", "2", "{", "}", ",", ".", "*", "**", " ", "['x']", "{0,2}", "x"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_BRACE_PIECES), min_size=0, max_size=8).map("".join))
def test_schema_and_reader_agree_on_alternatives(text: str) -> None:
    assert _schema_allows(text) is _parses(text)


def test_readable_rules_write_alternating_layers_as_alternatives() -> None:
    paths = [("layers", str(i), w) for i in range(9) for w in ("weight", "bias")]
    at = {p: i for i, p in enumerate(paths)}

    def leaves(layers: range | list[int], what: str) -> list[int]:
        return [at["layers", str(i), what] for i in layers]

    groups = [
        leaves(range(0, 8, 2), "weight"),
        leaves(range(0, 8, 2), "bias"),
        leaves(range(1, 8, 2), "weight"),
        leaves([8], "weight"),
    ]
    rules = readable_rules(paths, groups)
    assert rules == [
        ("layers.{0,2,4,6}.weight", 0),
        ("layers.{0,2,4,6}.bias", 1),
        ("layers.8.weight", 3),
        ("**.weight", 2),
    ]
    for k, path in enumerate(paths):
        first = next((g for text, g in rules if match(text, path)), None)
        assert first == next((g for g, members in enumerate(groups) if k in members), None)
