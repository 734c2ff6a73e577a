"""Prints the oldest versions pyproject.toml allows, as pins for `pip install -r`:
each `>=` lower bound of the dependencies and of the `test` extra made `==`, and
`jax[tpu]` (libtpu, which each JAX release pins) at JAX's lower bound.

The floor run of `.ci/run` installs them, so the bounds the metadata promises are
the versions tested. Left out: ruff and pyright (lint, not runtime).
"""

import re
import sys
import tomllib
from pathlib import Path

SKIP = {"ruff", "pyright"}

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
floors = {}
for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    name, _, bound = (part.strip() for part in requirement.partition(">="))
    if name in SKIP or name == "jax[tpu]":
        continue
    # X.Y, or a pre- or dev-release of it (jraph publishes only 0.0.6.dev0)
    if not re.fullmatch(r"[0-9][0-9.]*(?:(?:a|b|rc|\.dev)[0-9]+)?", bound):
        sys.exit(f"{requirement!r} has no lower bound to pin; give it one (>=X.Y)")
    floors[name] = bound
floors["jax[tpu]"] = floors.pop("jax")
for name, bound in floors.items():
    print(f"{name}=={bound}")
