"""eqshard: declare, check and apply how an Equinox model is sharded.

Every array leaf of a model gets an einshard expression such as `"x y -> x y*"`,
which says how the leaf is split and replicated across the devices.

The expression language and the spec-file layer (`parse`, `load`, `dump` of
`Rules`, `schema`, `FSDP`, the errors) import no JAX, so `eqshard validate` starts fast;
everything else is imported on first use.
"""

import importlib
import importlib.metadata
import sys
from typing import TYPE_CHECKING, Any

from ._errors import (
    EqshardError as EqshardError,
    EqshardWarning as EqshardWarning,
    ExpressionError as ExpressionError,
    MeshWarning as MeshWarning,
    PathError as PathError,
    Problem as Problem,
    SpecError as SpecError,
    UnreadableError as UnreadableError,
    UnusedRule as UnusedRule,
    UnusedRuleWarning as UnusedRuleWarning,
)
from ._expression import Element as Element, Expression as Expression, parse as parse
from ._fsdp import FSDP as FSDP
from ._layout import Layout as Layout, layout as layout
from ._protocol import SpecLeaf as SpecLeaf
from ._specfile._file import (
    Rule as Rule,
    Rules as Rules,
    dump as dump,
    load as load,
    schema as schema,
)

if (
    sys.modules.get("jax") is not None
):  # JAX's user context that keys `jit` by eqshard.use: see _jit_key
    from . import _jit_key  # noqa: F401

if TYPE_CHECKING:  # what the names below are, for type checkers; imported lazily
    from ._activations import use as use
    from ._apply import apply as apply
    from ._checkpoint import abstract as abstract, restore as restore
    from ._constrain import constrain as constrain, shard as shard
    from ._cost._driver import (
        Collective as Collective,
        Cost as Cost,
        Memory as Memory,
        cost as cost,
    )
    from ._cost._hardware import (
        HARDWARE as HARDWARE,
        Estimate as Estimate,
        Hardware as Hardware,
    )
    from ._fields import FROM_FIELDS as FROM_FIELDS, field as field
    from ._init import init as init
    from ._plan import Plan as Plan, Spec as Spec, plan as plan, spec as spec
    from ._protocol import (
        Resolution as Resolution,
        Resolver as Resolver,
        Target as Target,
    )
    from ._report import Report as Report, report as report
    from ._rules import Match as Match
    from ._search._diff import Diff as Diff, LeafChange as LeafChange, diff as diff
    from ._search._suggest import Ranked as Ranked, Suggestion as Suggestion, suggest as suggest
    from ._sharding import Devices as Devices, sharding as sharding
    from ._step import Step as Step, jit as jit

_LAZY = {
    "use": "._activations",
    "apply": "._apply",
    "abstract": "._checkpoint",
    "Collective": "._cost._driver",
    "Cost": "._cost._driver",
    "Memory": "._cost._driver",
    "cost": "._cost._driver",
    "Diff": "._search._diff",
    "LeafChange": "._search._diff",
    "diff": "._search._diff",
    "Estimate": "._cost._hardware",
    "HARDWARE": "._cost._hardware",
    "Hardware": "._cost._hardware",
    "restore": "._checkpoint",
    "FROM_FIELDS": "._fields",
    "field": "._fields",
    "init": "._init",
    "Plan": "._plan",
    "plan": "._plan",
    "Report": "._report",
    "report": "._report",
    "spec": "._plan",
    "Spec": "._plan",
    "Resolution": "._protocol",
    "Resolver": "._protocol",
    "Target": "._protocol",
    "Match": "._rules",
    "constrain": "._constrain",
    "shard": "._constrain",
    "sharding": "._sharding",
    "Devices": "._sharding",
    "Step": "._step",
    "jit": "._step",
    "Ranked": "._search._suggest",
    "Suggestion": "._search._suggest",
    "suggest": "._search._suggest",
}


__all__ = [  # the public API: `help(eqshard)` and `dir(eqshard)` list it
    "FROM_FIELDS",
    "FSDP",
    "HARDWARE",
    "Collective",
    "Cost",
    "Devices",
    "Diff",
    "Element",
    "EqshardError",
    "EqshardWarning",
    "Estimate",
    "Expression",
    "ExpressionError",
    "Hardware",
    "Layout",
    "LeafChange",
    "Match",
    "Memory",
    "MeshWarning",
    "PathError",
    "Plan",
    "Problem",
    "Ranked",
    "Report",
    "Resolution",
    "Resolver",
    "Rule",
    "Rules",
    "Spec",
    "SpecError",
    "SpecLeaf",
    "Step",
    "Suggestion",
    "Target",
    "UnreadableError",
    "UnusedRule",
    "UnusedRuleWarning",
    "abstract",
    "apply",
    "constrain",
    "cost",
    "diff",
    "dump",
    "field",
    "init",
    "jit",
    "layout",
    "load",
    "parse",
    "plan",
    "report",
    "restore",
    "schema",
    "shard",
    "sharding",
    "spec",
    "suggest",
    "use",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'eqshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


try:
    __version__ = importlib.metadata.version("eqshard")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0+unknown"
