"""The JSON Schema of spec files, and its validator.

The schema (Draft 2020-12) is one file, `schemas/eqshard.schema.json`, shipped in
the package as `eqshard/eqshard.schema.json`. Its `$id` is a URN, `urn:eqshard:schema:1`,
which names the format and is never fetched: every `$ref` in it is local. Editors
find it through a spec file's `"$schema"`, a path relative to the file (`dump` writes
one where the project keeps a copy, as `eqshard schema` prints it, in `schemas/`).
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import json
from typing import Any

from jsonschema import Draft202012Validator

__all__ = ["SCHEMA_FILE", "SCHEMA_FOLDER", "VERSION", "schema", "validator"]

VERSION = 1
"""The format version this eqshard reads and writes."""

SCHEMA_FILE = "eqshard.schema.json"
"""The schema's file name, in the package and in a project's `SCHEMA_FOLDER`."""

SCHEMA_FOLDER = "schemas"
"""The folder of a project that keeps a copy of the schema, for editors."""


@functools.cache
def _document() -> dict[str, Any]:
    text = importlib.resources.files("eqshard").joinpath(SCHEMA_FILE).read_text("utf-8")
    return json.loads(text)


def schema() -> dict[str, Any]:
    """The JSON Schema (Draft 2020-12) of eqshard spec files, as a new dict.

    **Example:**

    `json.dumps(eqshard.schema())`, or `eqshard schema` on the command line.
    `eqshard schema > schemas/eqshard.schema.json` keeps a copy for editors.
    `eqshard.dump` then points each spec file it writes at it.
    """
    return copy.deepcopy(_document())


@functools.cache
def validator() -> Draft202012Validator:
    """The schema's validator. It reads nothing but the schema itself: every `$ref`
    is local, and a spec file's `"$schema"` is any text, never followed."""
    return Draft202012Validator(_document())
