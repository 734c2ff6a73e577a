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
import warnings
from typing import TYPE_CHECKING, Any

from ._errors import (
    EqshardError as EqshardError,
    ExpressionError as ExpressionError,
    ModelError as ModelError,
    PathError as PathError,
    SpecError as SpecError,
    StepError as StepError,
    UnreadableError as UnreadableError,
    UsageError as UsageError,
)
from ._expression import Element as Element, Expression as Expression, parse as parse
from ._fsdp import FSDP as FSDP
from ._layout import Layout as Layout, layout as layout
from ._problems import Problem as Problem
from ._protocol import SpecLeaf as SpecLeaf
from ._specfile._model import BatchRules as BatchRules, Rule as Rule, Rules as Rules
from ._specfile._read import load as load
from ._specfile._schema import schema as schema
from ._specfile._write import dump as dump
from ._warnings import (
    EqshardWarning as EqshardWarning,
    IndivisibleBatchWarning as IndivisibleBatchWarning,
    MeshWarning as MeshWarning,
    UnusedRule as UnusedRule,
    UnusedRuleWarning as UnusedRuleWarning,
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
    from ._cost._driver import cost as cost
    from ._cost._hardware import (
        HARDWARE as HARDWARE,
        Estimate as Estimate,
        Hardware as Hardware,
    )
    from ._cost._results import (
        Collective as Collective,
        Cost as Cost,
        Memory as Memory,
    )
    from ._fields import FROM_FIELDS as FROM_FIELDS, field as field
    from ._init import init as init
    from ._pipeline import Stages as Stages, pipeline as pipeline
    from ._plan import Plan as Plan, Spec as Spec, plan as plan, spec_tree as spec_tree
    from ._protocol import (
        Resolution as Resolution,
        Resolver as Resolver,
        Target as Target,
    )
    from ._report import Report as Report, report as report
    from ._ring_attention import ring_attention as ring_attention
    from ._rules import Match as Match
    from ._search._diff import Diff as Diff, LeafChange as LeafChange, diff as diff
    from ._search._suggest import Ranked as Ranked, Suggestion as Suggestion, suggest as suggest
    from ._search._what_if import (
        TargetRow as TargetRow,
        Targets as Targets,
        suggest_targets as suggest_targets,
    )
    from ._sharding import Devices as Devices, sharding as sharding
    from ._step import Step as Step, jit as jit

_LAZY = {
    "use": "._activations",
    "apply": "._apply",
    "abstract": "._checkpoint",
    "Collective": "._cost._results",
    "Cost": "._cost._results",
    "Memory": "._cost._results",
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
    "spec_tree": "._plan",
    "Spec": "._plan",
    "Resolution": "._protocol",
    "Resolver": "._protocol",
    "Target": "._protocol",
    "Match": "._rules",
    "constrain": "._constrain",
    "shard": "._constrain",
    "ring_attention": "._ring_attention",
    "pipeline": "._pipeline",
    "Stages": "._pipeline",
    "sharding": "._sharding",
    "Devices": "._sharding",
    "Step": "._step",
    "jit": "._step",
    "Ranked": "._search._suggest",
    "Suggestion": "._search._suggest",
    "suggest": "._search._suggest",
    "TargetRow": "._search._what_if",
    "Targets": "._search._what_if",
    "suggest_targets": "._search._what_if",
}


__all__ = [  # the public API: `help(eqshard)` and `dir(eqshard)` list it
    "FROM_FIELDS",
    "FSDP",
    "HARDWARE",
    "BatchRules",
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
    "IndivisibleBatchWarning",
    "Layout",
    "LeafChange",
    "Match",
    "Memory",
    "MeshWarning",
    "ModelError",
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
    "Stages",
    "Step",
    "StepError",
    "Suggestion",
    "Target",
    "TargetRow",
    "Targets",
    "UnreadableError",
    "UnusedRule",
    "UnusedRuleWarning",
    "UsageError",
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
    "pipeline",
    "plan",
    "report",
    "restore",
    "ring_attention",
    "schema",
    "shard",
    "sharding",
    "spec_tree",
    "suggest",
    "suggest_targets",
    "use",
]


def __getattr__(name: str) -> Any:
    if name == "spec":  # renamed after 0.1.0: `Spec` and `spec=` are the other two
        warnings.warn(
            "`eqshard.spec` is now `eqshard.spec_tree` (it returns a model's spec tree)",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__("spec_tree")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'eqshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:  # the API only: not `importlib`, `Any` or the private modules
    return sorted([*__all__, "__version__"])


try:
    __version__ = importlib.metadata.version("eqshard")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0+unknown"
