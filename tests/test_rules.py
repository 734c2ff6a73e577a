import json
import os
import re
import signal
import socket
import stat
import threading
import urllib.parse
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float
from jsonschema import Draft202012Validator

import eqshard
from eqshard import EqshardError, SpecError, UnreadableError, UnusedRuleWarning
from eqshard._paths._match import match

SPECS = Path(__file__).parent / "specs"
ROOT = Path(__file__).parent.parent


# --------------------------------------------------------------------------- #
# Paths.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("blocks.0.attn.query_proj.weight", "blocks.0.attn.query_proj.weight", True),
        ("blocks.*.attn.query_proj.weight", "blocks.3.attn.query_proj.weight", True),
        ("blocks.*.attn.query_proj.weight", "blocks.attn.query_proj.weight", False),
        ("blocks.*.weight", "blocks.0.attn.weight", False),
        ("**.up.weight", "0.mu.blocks.0.up.weight", True),
        ("**.up.weight", "up.weight", True),  # '**' matches no segment too
        ("**.up.weight", "blocks.0.up.bias", False),
        ("blocks.**.weight", "blocks.weight", True),
        ("blocks.**.weight", "blocks.0.a.b.weight", True),
        ("**", "anything.at.all", True),
        ("*", "one", True),
        ("*", "one.two", False),
        ("a.**.b.**.c", "a.x.b.y.z.c", True),
        ("a.**.b.**.c", "a.x.c.b", False),
        ("layers.1", "layers.10", False),
    ],
)
def test_path_globs(pattern, path, matches):
    assert match(pattern, tuple(path.split("."))) is matches


def test_path_matching_has_no_catastrophic_backtracking():
    # A backtracking matcher takes exponential time on this; the DP, microseconds.
    # The thread bounds the test, so a regression fails instead of hanging.
    pattern = ".".join(["**", "a"] * 30) + ".*"
    result = []
    worker = threading.Thread(
        target=lambda: result.append(match(pattern, (*tuple(["a"] * 200), "b")))
    )
    worker.start()
    worker.join(timeout=30)
    assert result == [True]
    assert match(pattern, ("a",) * 29) is False


# --------------------------------------------------------------------------- #
# The schema.
# --------------------------------------------------------------------------- #


def test_schema_is_draft_2020_12_and_ships_in_the_package():
    schema = eqshard.schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == "urn:eqshard:schema:1"  # a name, never fetched
    assert schema["properties"]["eqshard"] == {"description": "The format version.", "const": 1}
    assert schema == json.loads((ROOT / "schemas" / "eqshard.schema.json").read_text("utf-8"))
    schema["title"] = "changed"
    assert eqshard.schema()["title"] != "changed"  # a fresh copy each time


def _objects(node):
    if isinstance(node, dict):
        if node.get("type") == "object":
            yield node
        for value in node.values():
            yield from _objects(value)
    elif isinstance(node, list):
        for value in node:
            yield from _objects(value)


def test_every_object_in_the_schema_refuses_unknown_keys():
    objects = list(_objects(eqshard.schema()))
    # the document, a rule, dims, the optimizer section, the batch section and its rule
    assert len(objects) == 6
    for obj in objects:
        assert obj.get("additionalProperties") is not None
        extra = obj["additionalProperties"]
        assert extra is False or "$ref" in extra or all("$ref" in one for one in extra["anyOf"])


_PATTERNS = [  # an expression matches both: its characters, and how they are put together
    re.compile(eqshard.schema()["$defs"][name]["pattern"]) for name in ("characters", "expression")
]


def _matches(text: str) -> bool:
    return all(pattern.search(text) for pattern in _PATTERNS)


@given(
    st.lists(
        st.sampled_from(
            ["a", "bc", "ω", "2", "1", "*", "...", "->", " ", "  ", "a2*", "0", "$", "-", "ⅷ", "²"]
        ),
        max_size=10,
    ).map("".join)
)
@settings(max_examples=400, deadline=None)
def test_the_expression_pattern_admits_what_parses(text):
    # Every expression that parses matches the pattern; a text that matches the
    # pattern but does not parse breaks a rule no regex can state (a name on one
    # side only, twice, or '...' on one side).
    try:
        eqshard.expression.parse(text)
    except eqshard.ExpressionError as error:
        if _matches(text):
            assert re.search(r"(on the (left|right) but not|appears twice)", error.rule), (
                text,
                error.rule,
            )
        return
    assert _matches(text), text


# --------------------------------------------------------------------------- #
# Loading: valid and invalid corpora, with the JSON path of every fault.
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("path", sorted((SPECS / "valid").glob("*.json")), ids=lambda p: p.name)
def test_valid_corpus_loads(path):
    rules = eqshard.load(path)
    assert rules.source == str(path)


def test_full_spec_loads_every_field():
    rules = eqshard.load(SPECS / "valid" / "full.eqshard.json")
    assert rules.devices == 8
    assert rules.default == "error"
    assert [r.path for r in rules.rules] == [
        "blocks.*.attn.query_proj.weight",
        "**.up.weight",
        "**",
    ]
    assert rules.rules[0].expr == eqshard.expression.parse("o i -> o* i")
    assert rules.rules[0].comment == "heads"
    short = rules.rules[1].expr
    assert isinstance(short, eqshard.expression.Expression)
    assert not short.is_complete
    assert dict(rules.dims) == {"mlp": "*", "vocab": "2", "heads": "2*"}
    assert rules.batch == eqshard.expression.parse("b ... -> b* ...")
    assert rules.comment == "every key the format has"


def test_the_files_and_the_sections_comments_round_trip(tmp_path):
    document = {
        "eqshard": 1,
        "comment": "the file's",
        "optimizer": {"comment": "the section's", "default": "fsdp"},
    }
    rules = eqshard.load(document)
    assert (rules.comment, rules.optimizer and rules.optimizer.comment) == (
        "the file's",
        "the section's",
    )
    eqshard.dump(rules, tmp_path / "again.eqshard.json")
    again = json.loads((tmp_path / "again.eqshard.json").read_text())
    assert (again["comment"], again["optimizer"]["comment"]) == ("the file's", "the section's")
    assert eqshard.load(eqshard.Rules(comment=None).to_json()).comment is None
    with pytest.raises(
        eqshard.EqshardError, match=r"`Rules.comment` is text for the reader, not 3"
    ):
        eqshard.Rules(comment=3)  # pyright: ignore[reportArgumentType]


INVALID = {
    "expressions.eqshard.json": [
        (
            "$.rules[0].expr",
            "axis 'z' is on the right but not on the left; add it to the left, or drop its name to replicate instead",
            "    x y -> x z\n             ^",
        ),
        (
            "$.rules[1].expr",
            "a count of 0 is not allowed; counts start at 1",
            "    x -> x0\n          ^",
        ),
        (
            "$.rules[2].expr",
            "unexpected character ','; einshard expressions separate axes with spaces, and group names only with '(' and ')' on the left side",
            "    x, y -> x y\n     ^",
        ),
    ],
    "structure.eqshard.json": [
        (
            "$",
            "unknown key 'model'; the keys here are '$schema', 'eqshard', 'comment', 'devices', 'mesh', 'default', 'rules', 'dims', 'logical_axis_rules', 'batch', 'optimizer'",
            "",
        ),
        ("$.default", "'maybe' is not one of ['replicate', 'error', 'fsdp']", ""),
        (
            "$.devices",
            "0 is not a device count: a whole number from 1 to 2147483647, the most devices a "
            "JAX sharding can describe",
            "",
        ),
        (
            "$.dims",
            "dim name '1d' is not a logical name: a letter or '_', then letters, '_', digits, '-' or '.'",
            "",
        ),
        (
            "$.dims.mlp",
            "'2two' is neither a shard modifier ('2', '*', '2*'), the name of a mesh axis, a list of them (the major first), nor null (a whole dim)",
            "",
        ),
        ("$.eqshard", "unsupported version 2; this eqshard reads version 1", ""),
        (
            "$.rules[0].path",
            "white space in a segment; a key holding '.', '*', white space, a bracket or a "
            "quote is written quoted, as eqshard names it: ['a b']",
            "    a b\n     ^",
        ),
        (
            "$.rules[1].expr",
            "3 is not of type 'string'; write an einshard expression such as 'o i -> o* i', "
            "or 'fsdp'",
            "",
        ),
        (
            "$.rules[2]",
            "missing key 'expr' or 'dims': a rule has one, an einshard expression (or 'fsdp') "
            "or its leaves' dims by name ('... hidden embed')",
            "",
        ),
        (
            "$.rules[3]",
            "unknown key 'shard'; the keys here are 'path', 'expr', 'dims', 'comment', 'memory'",
            "",
        ),
    ],
    "shadowed.eqshard.json": [
        (
            "$.rules[1].path",
            "this rule can never match: $.rules[0] has the same path '**.w' and comes first; remove one",
            "",
        ),
    ],
    "not-an-object.eqshard.json": [("$", "['eqshard', 1] is not of type 'object'", "")],
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_corpus_reports_every_fault_with_its_json_path(name):
    path = SPECS / "invalid" / name
    with pytest.raises(SpecError) as info:
        eqshard.load(path)
    got = [(p.where, p.message, p.detail) for p in info.value.problems]
    assert got == [
        (f"{path}::{where}", message, detail) for where, message, detail in INVALID[name]
    ]
    assert str(info.value).startswith(f"{path} is not a valid eqshard spec:\n  {path}::")


def test_broken_json_names_line_and_column():
    path = SPECS / "invalid" / "broken.eqshard.json"
    with pytest.raises(SpecError) as info:
        eqshard.load(path)
    with pytest.raises(json.JSONDecodeError) as python:  # its words change with Python
        json.loads(path.read_text())
    fault = python.value
    assert (fault.lineno, fault.colno) in [(4, 37), (4, 36)]
    assert [str(p) for p in info.value.problems] == [
        f"{path}::line {fault.lineno}, column {fault.colno}: invalid JSON: {fault.msg}"
    ]


def test_duplicate_keys_are_refused():
    path = SPECS / "invalid" / "duplicate-key.eqshard.json"
    with pytest.raises(SpecError, match="the key 'rules' appears twice in one object; keep one"):
        eqshard.load(path)


def test_unreadable_too_large_and_not_utf8(tmp_path):
    with pytest.raises(
        UnreadableError, match=r"missing\.json: cannot read it: No such file or directory"
    ):
        eqshard.load(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    big.write_text('{"eqshard": 1, "comment": "' + "x" * (1 << 20) + '"}')
    with pytest.raises(
        UnreadableError, match=r"the file is over the 1048576-byte limit for spec files"
    ):
        eqshard.load(big)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"eqshard": 1, "comment": "caf\xe9"}')
    with pytest.raises(UnreadableError, match=r"it is not UTF-8 \(byte 30\)"):
        eqshard.load(latin)
    nan = tmp_path / "nan.json"
    nan.write_text('{"eqshard": 1, "devices": NaN}')
    with pytest.raises(SpecError, match="NaN is not valid JSON"):
        eqshard.load(nan)


def test_load_takes_a_mapping():
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "w", "expr": "a -> a*"}]})
    assert rules.source == "<mapping>"
    with pytest.raises(SpecError, match=re.escape("<mapping>::$.rules[0].expr: a count of 0")):
        eqshard.load({"eqshard": 1, "rules": [{"path": "w", "expr": "a -> a0"}]})


def test_a_spec_file_never_runs_code(tmp_path):
    marker = tmp_path / "ran"
    spec = tmp_path / "evil.json"
    code = f"__import__('os').system('touch {marker}')"
    rule = {"path": "[\"exec(open('x'))\"]", "expr": "a -> a*", "comment": code}
    spec.write_text(json.dumps({"eqshard": 1, "$schema": code, "rules": [rule]}))
    rules = eqshard.load(spec)
    with pytest.warns(UnusedRuleWarning):
        eqshard.apply({"w": jnp.ones(8)}, rules)
    # a quoted key is read by hand, never evaluated: code in brackets is refused
    for path in (f"[{code}]", f"['' + {code}]", f"[''.join({code})]"):
        with pytest.raises(SpecError, match=r"\$\.rules\[0\]\.path: "):
            eqshard.load({"eqshard": 1, "rules": [{"path": path, "expr": "a -> a*"}]})
    assert not marker.exists()


# --------------------------------------------------------------------------- #
# Resolving rules against real models.
# --------------------------------------------------------------------------- #


class Unembed(eqx.Module):
    w: Float[Array, "vocab embed"]


def block(key=None):
    key = jax.random.key(0) if key is None else key
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "attn": eqx.nn.MultiheadAttention(8, 32, key=k1),
        "up": eqx.nn.Linear(32, 64, key=k2),
        "down": eqx.nn.Linear(64, 32, key=k3),
        "norm": eqx.nn.LayerNorm(32),
        "unembed": Unembed(jnp.ones((64, 32))),
    }


MEGATRON = {
    "eqshard": 1,
    "rules": [
        {"path": "**.attn.query_proj.weight", "expr": "o i -> o* i"},
        {"path": "**.attn.output_proj.weight", "expr": "o i -> o i*"},
        {"path": "**.up.weight", "expr": "o i -> o* i"},
        {"path": "**.up.bias", "expr": "o -> o*"},
        {"path": "**.down.weight", "expr": "o i -> o i*"},
    ],
    "dims": {"vocab": "*"},
}


def test_rules_report_which_rule_matched_each_leaf():
    rules = eqshard.load(MEGATRON)
    matches, problems = rules.match(block())
    assert problems == []
    by_path = {
        m.path: (m.source, m.rule_index, None if m.expr is None else str(m.expr)) for m in matches
    }
    assert by_path["attn.query_proj.weight"] == ("rule", 0, "o i -> o* i")
    assert by_path["attn.key_proj.weight"] == ("default", None, "... -> * ...")
    assert by_path["down.weight"] == ("rule", 4, "o i -> o i*")
    assert by_path["unembed.w"] == ("dims", None, "vocab embed -> vocab* embed")
    assert by_path["norm.weight"] == ("default", None, "... -> * ...")


def test_rules_apply_to_a_block_and_to_its_optax_state():
    rules = eqshard.load(MEGATRON)
    model = eqshard.apply(block(), rules)
    assert model["up"].weight.sharding.spec == P("m0", None)
    assert model["down"].weight.sharding.spec == P(None, "m0")
    assert model["unembed"].w.sharding.spec == P("m0", None)
    assert model["norm"].weight.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(model["up"].weight), np.asarray(block()["up"].weight))

    optimizer = optax.adam(1e-3)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedRuleWarning)  # the state mirrors the model
        placed = eqshard.apply(state, rules)
    mu, nu = placed[0].mu, placed[0].nu
    assert mu["up"].weight.sharding.spec == P("m0", None)
    assert nu["down"].weight.sharding.spec == P(None, "m0")
    assert mu["unembed"].w.sharding.spec == P("m0", None)  # dims reach the state too
    assert placed[0].count.sharding.is_fully_replicated


def test_unused_rules_warn_in_apply():
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "**.nowhere", "expr": "a -> a*"}]})
    with pytest.warns(
        UnusedRuleWarning,
        match=re.escape("<mapping>::$.rules[0]: rule '**.nowhere' matched no leaf of the model"),
    ):
        eqshard.apply({"w": jnp.ones(8)}, rules)


def test_default_error_lists_every_unmatched_leaf():
    rules = eqshard.load(
        {"eqshard": 1, "default": "error", "rules": [{"path": "up.weight", "expr": "o i -> o* i"}]}
    )
    model = {"up": eqx.nn.Linear(4, 8, key=jax.random.key(0))}
    with pytest.raises(SpecError) as info:
        eqshard.apply(model, rules)
    assert [str(p) for p in info.value.problems] == [
        'up.bias (Linear.bias): no rule or dim matches this leaf, and <mapping> says "default": "error"; add a rule whose path matches it, or set "default": "replicate"'
    ]


def test_declared_device_count_is_checked():
    rules = eqshard.load({"eqshard": 1, "devices": 4})
    with pytest.raises(
        SpecError,
        match=re.escape(
            '<mapping>::$.devices: the spec was written for 4 devices, and it is laid out on 8; use 4 devices, or change "devices"'
        ),
    ):
        eqshard.apply({"w": jnp.ones(8)}, rules)
    placed = eqshard.apply({"w": jnp.ones(8)}, rules, devices=jax.devices()[:4])
    assert len(placed["w"].sharding.device_set) == 4


def test_rules_resolve_on_abstract_models():
    rules = eqshard.load(MEGATRON)
    abstract = eqx.filter_eval_shape(block)
    spec = eqshard.spec_tree(abstract, rules)
    assert spec["up"].weight == eqshard.expression.parse("o i -> o* i")
    assert eqshard.plan(abstract, rules).partition_specs["down"].weight == P(None, "m0")


def test_short_form_rules_take_the_annotation():
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "unembed.w", "expr": "vocab* embed"}]})
    spec = eqshard.spec_tree(block(), rules)
    assert str(spec["unembed"].w) == "vocab embed -> vocab* embed"


# --------------------------------------------------------------------------- #
# dump, then load: the same layouts.
# --------------------------------------------------------------------------- #


def test_dump_a_spec_tree_and_load_it_back(tmp_path):
    model = block()
    spec = eqshard.spec_tree(model, eqshard.load(MEGATRON))
    path = tmp_path / "block.eqshard.json"
    eqshard.dump(spec, path, devices=8)
    document = json.loads(path.read_text())
    assert "$schema" not in document  # no copy of the schema in the project
    assert document["devices"] == 8
    assert {"path": "up.weight.**", "expr": "o i -> o* i"} in document["rules"]
    loaded = eqshard.load(path)
    before = eqshard.plan(model, spec).partition_specs
    after = eqshard.plan(model, loaded).partition_specs
    assert jax.tree_util.tree_leaves(before) == jax.tree_util.tree_leaves(after)
    assert jax.tree_util.tree_structure(before) == jax.tree_util.tree_structure(after)


def test_dump_rules_round_trips(tmp_path):
    rules = eqshard.load(SPECS / "valid" / "full.eqshard.json")
    path = tmp_path / "again.json"
    eqshard.dump(rules, path)
    again = eqshard.load(path)
    assert again.rules == rules.rules
    assert (again.default, again.devices, dict(again.dims), again.batch) == (
        rules.default,
        rules.devices,
        dict(rules.dims),
        rules.batch,
    )
    assert rules.batch is not None
    assert json.loads(path.read_text("utf-8"))["batch"] == "b ... -> b* ..."


def _project(root: Path) -> Path:
    """A repository at `root` that keeps a copy of the schema, as `eqshard schema`
    prints it, in `schemas/`."""
    (root / ".git").mkdir(parents=True)
    (root / "schemas").mkdir()
    (root / "schemas" / "eqshard.schema.json").write_text(json.dumps(eqshard.schema()))
    return root


@pytest.mark.parametrize(
    ("folder", "reference"),
    [
        ("", "schemas/eqshard.schema.json"),
        ("specs", "../schemas/eqshard.schema.json"),
        ("specs/with space", "../../schemas/eqshard.schema.json"),
    ],
)
def test_dump_points_schema_at_the_projects_copy(tmp_path, folder, reference):
    project = _project(tmp_path / "project")
    path = project / folder / "model.eqshard.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    eqshard.dump({"w": "a -> a*"}, path)
    document = json.loads(path.read_text("utf-8"))
    assert next(iter(document)) == "$schema"  # first, where editors look
    assert document["$schema"] == reference
    # it resolves against the file, as an editor resolves it: no network
    found = path.parent / urllib.parse.unquote(document["$schema"])
    assert found.resolve() == (project / "schemas" / "eqshard.schema.json").resolve()
    assert list(Draft202012Validator(json.loads(found.read_text())).iter_errors(document)) == []
    assert [rule.path for rule in eqshard.load(path).rules] == ["w.**"]


def test_dump_looks_for_the_schema_no_further_than_the_repository(tmp_path):
    (tmp_path / "schemas").mkdir()  # above the repository: not the project's copy
    (tmp_path / "schemas" / "eqshard.schema.json").write_text("{}")
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    inside = tmp_path / "repo" / "model.eqshard.json"
    eqshard.dump({"w": "a -> a*"}, inside)
    assert list(json.loads(inside.read_text("utf-8"))) == ["eqshard", "default", "rules"]
    outside = tmp_path / "elsewhere" / "model.eqshard.json"  # in no repository
    outside.parent.mkdir()
    eqshard.dump({"w": "a -> a*"}, outside)
    assert json.loads(outside.read_text("utf-8"))["$schema"] == "../schemas/eqshard.schema.json"
    assert "$schema" not in eqshard.Rules().to_json()  # where a file lies is dump's to say


@pytest.mark.parametrize(
    "reference",
    [
        "https://eqshard.dev/schemas/eqshard-1.schema.json",  # the old `$id`: no such site
        "urn:eqshard:schema:1",
        "http://127.0.0.1:9/eqshard.schema.json",
        "../no/such/file.json",
        "",
    ],
)
def test_any_schema_reference_is_read_and_never_followed(tmp_path, monkeypatch, reference):
    def no_network(*args, **kwargs):
        raise AssertionError("eqshard tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    path = tmp_path / "model.eqshard.json"
    path.write_text(json.dumps({"$schema": reference, "eqshard": 1, "rules": []}))
    assert eqshard.load(path).rules == ()


def test_the_schema_refers_only_to_itself():
    def refs(node):
        if isinstance(node, dict):
            yield from (v for k, v in node.items() if k == "$ref")
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    found = list(refs(eqshard.schema()))
    assert found
    assert all(ref.startswith("#/") for ref in found)  # nothing to fetch


def test_dump_a_prefix_spec_and_load_it_back(tmp_path):
    model = {"enc": {"a": jnp.ones((4, 8)), "b": jnp.ones(8)}, "dec": jnp.ones((4, 8))}
    spec = {"enc": "... x -> ... x*", "dec": None}
    eqshard.dump(spec, tmp_path / "prefix.json")
    assert json.loads((tmp_path / "prefix.json").read_text())["rules"] == [
        {"path": "enc.**", "expr": "... x -> ... x*"}
    ]
    loaded = eqshard.load(tmp_path / "prefix.json")
    assert eqshard.plan(model, loaded).partition_specs == eqshard.plan(model, spec).partition_specs
    eqshard.dump("... -> * ...", tmp_path / "root.json")
    assert eqshard.load(tmp_path / "root.json").rules[0].path == "**"


def test_keep_does_not_override_a_files_default_replicate():
    rules = eqshard.load({"eqshard": 1})
    x = jax.device_put(jnp.ones(8), jax.devices()[0])
    placed = eqshard.apply({"x": x}, rules, unspecified="keep")
    assert placed["x"].sharding.is_fully_replicated
    assert len(placed["x"].sharding.device_set) == 8


def test_unused_rule_warning_points_at_the_callers_line():
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "nowhere", "expr": "a -> a*"}]})
    with pytest.warns(UnusedRuleWarning) as caught:
        eqshard.apply({"w": jnp.ones(8)}, rules)
    assert caught[0].filename == __file__


def test_schema_patterns_refuse_a_trailing_newline():
    with pytest.raises(SpecError, match=re.escape("$.rules[0].path: white space in a segment")):
        eqshard.load({"eqshard": 1, "rules": [{"path": "w\n", "expr": "a -> a*"}]})
    with pytest.raises(
        SpecError, match=re.escape("dim name " + repr("a\n") + " is not a logical name")
    ):
        eqshard.load({"eqshard": 1, "dims": {"a\n": "*"}})


def test_devices_is_a_whole_number():
    assert eqshard.load({"eqshard": 1, "devices": 8.0}).devices == 8
    with pytest.raises(SpecError, match=r"\$\.devices: 8\.5 is not a device count: a whole number"):
        eqshard.load({"eqshard": 1, "devices": 8.5})
    with pytest.raises(eqshard.EqshardError, match="takes a path or a mapping, not int"):
        eqshard.load(123)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": 8.0}, r"`Rules.devices` is a whole number from 1, not 8\.0"),
        ({"devices": True}, r"`Rules.devices` is a whole number from 1, not True"),
        ({"devices": 2**31}, r"`Rules.devices` is 2147483648, more than 2147483647, the most"),
        (
            {"mesh": (("data", 0),)},
            r"the size of `Rules.mesh`'s axis 'data' is a whole number from 1, not 0",
        ),
        (
            {"mesh": (("data", None), ("model", "2"))},
            r"axis 'model' is a whole number from 1, not '2'",
        ),
    ],
)
def test_rules_counts_are_whole_numbers_of_devices(kwargs, message):
    """A `Rules` built by hand is checked as a spec file's are: its device count and
    mesh sizes are whole numbers from 1 to `MAX_DEVICES`."""
    with pytest.raises(EqshardError, match=message):
        eqshard.Rules(**kwargs)


@pytest.mark.parametrize("size", [0, 10**20, 2.5, "x", True])
def test_a_mesh_size_is_a_whole_number_of_devices(tmp_path, size):
    """The schema's anyOf (a size, or '*') said only 'is not valid under any of the
    given schemas'."""
    path = tmp_path / "mesh.eqshard.json"
    path.write_text(json.dumps({"eqshard": 1, "mesh": [["data", "*"], ["model", size]]}))
    with pytest.raises(SpecError) as caught:
        eqshard.load(path)
    assert caught.value.problems[0].where == f"{path}::$.mesh[1][1]"
    message = (
        f"{path}::$.mesh[1][1]: {size!r} is not a mesh axis size: a whole number from 1 to "
        "2147483647, the most devices a JAX sharding can describe, or '*' for what the "
        "device count leaves"
    )
    assert str(caught.value).splitlines()[1:] == [f"  {message}"]


def test_the_schemas_counts_go_up_to_max_devices():
    from eqshard._layout import MAX_DEVICES

    schema = eqshard.schema()
    size = schema["$defs"]["mesh_axis"]["prefixItems"][1]["anyOf"][0]
    assert size["maximum"] == schema["properties"]["devices"]["maximum"] == MAX_DEVICES
    rules = eqshard.load({"eqshard": 1, "devices": MAX_DEVICES, "mesh": [["d", MAX_DEVICES]]})
    assert rules.mesh == (("d", MAX_DEVICES),)


def test_deeply_nested_json_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="the JSON nests too deeply to read"):
        eqshard.load(path)


def test_dump_writes_through_a_symbolic_link_and_keeps_it(tmp_path):
    (tmp_path / "specs").mkdir()
    target = tmp_path / "specs" / "model.eqshard.json"
    target.write_text("{}")
    target.chmod(0o640)
    link = tmp_path / "model.eqshard.json"
    link.symlink_to(Path("specs") / "model.eqshard.json")  # relative, as in a repository
    chain = tmp_path / "chain.json"
    chain.symlink_to(link)  # a link to the link
    for written, expr in ((link, "a -> a*"), (chain, "a b -> a b*")):
        eqshard.dump({"w": expr}, written)
        assert link.is_symlink()
        assert os.readlink(link) == os.path.join("specs", "model.eqshard.json")
        assert chain.is_symlink()
        assert os.readlink(chain) == str(link)
        rules = json.loads(target.read_text())["rules"]
        assert rules == [{"path": "w.**", "expr": expr}]
        assert stat.S_IMODE(target.stat().st_mode) == 0o640  # the file's own mode, kept
    dangling = tmp_path / "new.json"
    dangling.symlink_to(tmp_path / "specs" / "new.eqshard.json")  # its file is not there yet
    eqshard.dump({"w": "a -> a*"}, dangling)
    assert dangling.is_symlink()
    assert eqshard.load(tmp_path / "specs" / "new.eqshard.json")
    assert sorted(p.name for p in tmp_path.rglob("*")) == [  # no temporary file left behind
        "chain.json",
        "model.eqshard.json",
        "model.eqshard.json",
        "new.eqshard.json",
        "new.json",
        "specs",
    ]
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(EqshardError, match="is a symbolic link that leads to itself"):
        eqshard.dump({"w": "a -> a*"}, tmp_path / "loop")


def test_dump_writes_every_key_quoted_where_it_must_be(tmp_path):
    model = {"a.b": jnp.ones(8), "c d": {"e": jnp.ones(8)}, "it's": [jnp.ones(8)]}
    spec = {"a.b": "x -> x*", "c d": "... x -> ... x*", "it's": ["x -> 2* x"]}
    eqshard.dump(spec, tmp_path / "x.json")
    assert [r["path"] for r in json.loads((tmp_path / "x.json").read_text())["rules"]] == [
        "['a.b'].**",
        "['c d'].**",
        '["it\'s"].0.**',
    ]
    loaded = eqshard.load(tmp_path / "x.json")
    assert eqshard.plan(model, loaded).partition_specs == eqshard.plan(model, spec).partition_specs
    with pytest.raises(SpecError, match=re.escape("['a.b']: int is not an expression")):
        eqshard.dump({"a.b": 3}, tmp_path / "y.json")


@pytest.mark.parametrize(
    ("paths", "winner"),
    [
        (["**.w", "blocks.*.w", "blocks.0.*"], 0),
        (["blocks.0.*", "**.w"], 0),
        (["blocks.1.*", "**", "blocks.0.w"], 1),
        (["x.w", "blocks.0.w", "**.w"], 1),
        (["**.v", "*.*.w"], 1),
    ],
)
def test_the_first_matching_rule_wins(paths, winner):
    exprs = ["a -> a*", "a -> * a", "a -> 2* a", "a -> a 2*"]
    rules = eqshard.load(
        {"eqshard": 1, "rules": [{"path": p, "expr": e} for p, e in zip(paths, exprs)]}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedRuleWarning)
        matches, _ = rules.match({"blocks": [{"w": jnp.ones(8)}]})
    assert [(m.path, m.rule_index) for m in matches] == [("blocks.0.w", winner)]


# --------------------------------------------------------------------------- #
# Files under bad input: dump writes whole files that load, or nothing, and load
# names what it cannot read.
# --------------------------------------------------------------------------- #

ONE_RULE = {"eqshard": 1, "rules": [{"path": "**.w", "expr": "a -> a*"}]}


@pytest.fixture
def existing(tmp_path: Path) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(ONE_RULE))
    return path


def _untouched(path: Path) -> None:
    assert json.loads(path.read_text()) == ONE_RULE
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_dump_of_a_lone_surrogate_writes_nothing(existing: Path):
    rules = eqshard.load({"eqshard": 1, "rules": [{"path": "**.w\udc80", "expr": "a -> a*"}]})
    with pytest.raises(EqshardError, match=r"not written: .* a lone surrogate"):
        eqshard.dump(rules, existing)
    _untouched(existing)


def test_dump_is_atomic_when_the_disk_fails(existing: Path, monkeypatch: pytest.MonkeyPatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(EqshardError, match=r"cannot write .*: No space left on device"):
        eqshard.dump(eqshard.load(ONE_RULE), existing)
    _untouched(existing)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_dump_refuses_a_fifo_without_hanging(tmp_path: Path):
    fifo = tmp_path / "spec.json"
    os.mkfifo(fifo)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("dump hung on a FIFO"))
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        with pytest.raises(EqshardError, match="is not a regular file"):
            eqshard.dump(eqshard.load(ONE_RULE), fifo)
        with pytest.raises(UnreadableError, match="is not a regular file"):
            eqshard.load(fifo)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_dump_to_a_directory_is_an_eqshard_error(tmp_path: Path):
    with pytest.raises(EqshardError) as info:
        eqshard.dump({"w": "a -> a*"}, tmp_path)
    assert str(info.value) == f"not written: {tmp_path} is not a regular file (a directory or pipe)"


@pytest.mark.parametrize(
    ("spec", "devices", "message"),
    [
        (
            eqshard.Rules(
                (
                    eqshard.Rule("w", eqshard.expression.parse("a -> a*")),
                    eqshard.Rule("w", eqshard.expression.parse("a -> a2*"), index=1),
                )
            ),
            None,
            r"\$\.rules\[1\]\.path: this rule can never match: \$\.rules\[0\] has the same path",
        ),
    ],
    ids=["paths that print alike"],
)
def test_dump_never_writes_a_file_load_would_reject(existing: Path, spec, devices, message):
    source = spec if isinstance(spec, eqshard.Rules) else eqshard.load(spec)
    with pytest.raises(SpecError, match=message):
        eqshard.dump(source, existing, devices=devices)
    _untouched(existing)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: eqshard.dump({"w": "a -> a*"}, None), "writes to a path, not NoneType"),  # type: ignore[arg-type]
        (
            lambda: eqshard.dump({"w": "a -> a*"}, "x.json", devices=True),
            "whole number from 1, not True",
        ),
        (
            lambda: eqshard.dump(eqshard.load(ONE_RULE), "x.json", devices=2**31),
            r"`devices` is 2147483648, more than 2147483647, the most devices a JAX sharding",
        ),
    ],
    ids=["no path", "a bool count", "devices over the maximum"],
)
def test_bad_arguments_to_dump_are_eqshard_errors(call, message):
    with pytest.raises(EqshardError, match=message):
        call()


def test_a_rule_needs_a_path_and_a_path_has_no_nul(tmp_path: Path):
    with pytest.raises(EqshardError, match=r"`Rule\.path` is a dotted glob"):
        eqshard.Rule(None, "a -> a*")  # type: ignore[arg-type]
    with pytest.raises(UnreadableError, match=r"cannot read it: .*embedded null (byte|character)"):
        eqshard.load(str(tmp_path / "a\0b.json"))
    with pytest.raises(EqshardError, match=r"cannot write .*embedded null (byte|character)"):
        eqshard.dump(eqshard.load(ONE_RULE), str(tmp_path / "a\0b.json"))


def test_a_byte_order_mark_is_read_as_utf8(tmp_path: Path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ONE_RULE).encode())
    assert eqshard.load(path).rules[0].path == "**.w"


def test_a_directory_is_named_once(tmp_path: Path):
    with pytest.raises(UnreadableError) as info:
        eqshard.load(tmp_path)
    assert str(info.value) == (
        f"unreadable:\n  {tmp_path}: it is not a regular file (a directory, pipe or device)"
    )


def test_file_problems_know_their_file_even_when_its_name_has_double_colons(tmp_path: Path):
    path = tmp_path / "a::b.json"
    path.write_text(json.dumps({"eqshard": 1, "rules": [{"path": "w", "expr": "a -> b"}]}))
    with pytest.raises(SpecError) as info:
        eqshard.load(path)
    [problem] = info.value.problems
    assert (problem.file, problem.json_path) == (str(path), "$.rules[0].expr")
