"""eqshard: declare, check and apply how an Equinox model is sharded.

Every array leaf of a model gets an einshard expression such as `"x y -> x y*"`,
which says how the leaf is split and replicated across the devices.

The top level holds what a training script needs: the spec (`field`, `Rules`,
`load`), the plan and its placing (`plan`, `apply`, `constrain`, `jit`, `init`,
`restore`), what it costs (`report`, `cost`, `suggest`, `diff`), and the errors.
The rest lives in namespaces: `eqshard.expression` (the language, one array at a
time), `eqshard.results` (what the functions return), `eqshard.targets` (hardware),
`eqshard.parallel` (pipeline stages, ring attention), `eqshard.resolvers` (spec
sources of your own) and `eqshard.testing`.

The spec-file layer (`load`, `dump`, `Rules`, `FSDP`, the errors) imports no JAX,
so `eqshard validate` starts fast; everything else is imported on first use.
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
from ._fsdp import FSDP as FSDP
from ._specfile._model import BatchRules as BatchRules, Rule as Rule, Rules as Rules
from ._specfile._read import load as load
from ._specfile._schema import schema as schema
from ._specfile._write import dump as dump
from ._warnings import (
    EqshardWarning as EqshardWarning,
    IndivisibleBatchWarning as IndivisibleBatchWarning,
    MeshWarning as MeshWarning,
    UnusedRuleWarning as UnusedRuleWarning,
    VersionWarning as VersionWarning,
)

if (
    sys.modules.get("jax") is not None
):  # JAX's user context that keys `jit` by eqshard.use: see _jit_key
    from . import _jit_key  # noqa: F401

if TYPE_CHECKING:  # what the names below are, for type checkers; imported lazily
    from . import (
        expression as expression,
        parallel as parallel,
        resolvers as resolvers,
        results as results,
        targets as targets,
        testing as testing,
    )
    from ._activations import use as use
    from ._apply import apply as apply
    from ._checkpoint import abstract as abstract, restore as restore
    from ._constrain import constrain as constrain
    from ._cost._driver import cost as cost
    from ._fields import field as field
    from ._init import init as init
    from ._plan import Plan as Plan, Spec as Spec, plan as plan, spec_tree as spec_tree
    from ._report import report as report
    from ._search._diff import diff as diff
    from ._search._suggest import suggest as suggest
    from ._step import jit as jit

_LAZY = {  # a name of the top level, and the private module that holds it
    "use": "._activations",
    "apply": "._apply",
    "abstract": "._checkpoint",
    "restore": "._checkpoint",
    "constrain": "._constrain",
    "cost": "._cost._driver",
    "field": "._fields",
    "init": "._init",
    "Plan": "._plan",
    "Spec": "._plan",
    "plan": "._plan",
    "spec_tree": "._plan",
    "report": "._report",
    "diff": "._search._diff",
    "suggest": "._search._suggest",
    "jit": "._step",
}

_NAMESPACES = ("expression", "parallel", "resolvers", "results", "targets", "testing")

# Names the top level had before 0.2: each still works, with a `DeprecationWarning`
# naming where it lives now. To be removed in the release after.
_MOVED = {
    **dict.fromkeys(("Element", "Expression", "Layout", "layout", "parse"), "expression"),
    **dict.fromkeys(("Devices", "sharding"), "expression"),
    **dict.fromkeys(("Collective", "Cost", "Memory", "Report", "Step"), "results"),
    **dict.fromkeys(("Diff", "LeafChange", "Ranked", "Suggestion"), "results"),
    **dict.fromkeys(("HARDWARE", "Estimate", "Hardware"), "targets"),
    **dict.fromkeys(("TargetRow", "Targets", "suggest_targets"), "targets"),
    **dict.fromkeys(("Stages", "pipeline", "ring_attention"), "parallel"),
    **dict.fromkeys(("FROM_FIELDS", "Match", "Problem", "Resolution"), "resolvers"),
    **dict.fromkeys(("Resolver", "SpecLeaf", "Target", "UnusedRule"), "resolvers"),
}
_RENAMED = {  # an old name, its replacement, and how to write the new call
    "spec": ("spec_tree", "`eqshard.spec` is now `eqshard.spec_tree`"),
    "shard": (
        "._constrain:shard",
        "`eqshard.shard(x, expr)` is now `eqshard.apply(x, expr)`, the one placing verb",
    ),
}


__all__ = [  # the public API: `help(eqshard)` and `dir(eqshard)` list it
    "FSDP",
    "BatchRules",
    "EqshardError",
    "EqshardWarning",
    "ExpressionError",
    "IndivisibleBatchWarning",
    "MeshWarning",
    "ModelError",
    "PathError",
    "Plan",
    "Rule",
    "Rules",
    "Spec",
    "SpecError",
    "StepError",
    "UnreadableError",
    "UnusedRuleWarning",
    "UsageError",
    "VersionWarning",
    "abstract",
    "apply",
    "constrain",
    "cost",
    "diff",
    "dump",
    "field",
    "init",
    "jit",
    "load",
    "plan",
    "report",
    "restore",
    "schema",
    "spec_tree",
    "suggest",
    "use",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif name in _NAMESPACES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _MOVED:
        namespace = _MOVED[name]
        warnings.warn(
            f"`eqshard.{name}` is now `eqshard.{namespace}.{name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(f".{namespace}", __name__), name)
    elif name in _RENAMED:
        where, message = _RENAMED[name]
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        module, _, attribute = where.rpartition(":")
        if not module:
            return __getattr__(attribute)
        return getattr(importlib.import_module(module, __name__), attribute)
    else:
        raise AttributeError(f"module 'eqshard' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:  # the API only: not `importlib`, `Any` or the private modules
    return sorted([*__all__, *_NAMESPACES, "__version__"])


try:
    __version__ = importlib.metadata.version("eqshard")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0+unknown"
