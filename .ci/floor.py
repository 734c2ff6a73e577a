"""Prints the oldest versions pyproject.toml allows, as pins for `pip install -r`:
each `>=` lower bound of the dependencies and of the `test` extra made `==`.

The floor run of `.ci/run` installs them, so the bounds the metadata promises are
the versions tested. Left out: `jax[tpu]` (libtpu, which is pinned to each JAX
release and tested by the main run), and ruff and pyright (lint, not runtime).
"""

import re
import sys
import tomllib
from pathlib import Path

SKIP = {"jax[tpu]", "ruff", "pyright"}

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
for requirement in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
    name, _, bound = requirement.partition(">=")
    if name.strip() in SKIP or requirement.strip() in SKIP:
        continue
    if not bound or not re.fullmatch(r"[0-9][0-9.]*", bound.strip()):
        sys.exit(f"{requirement!r} has no lower bound to pin; give it one (>=X.Y)")
    print(f"{name.strip()}=={bound.strip()}")
