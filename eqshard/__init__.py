"""eqshard: declare, check and apply how an Equinox model is sharded.

Every array leaf of a model gets an einshard expression such as `"x y -> x y*"`,
which says how the leaf is split and replicated across the devices.
"""

import importlib.metadata

from ._apply import apply as apply
from ._errors import (
    EqshardError as EqshardError,
    ExpressionError as ExpressionError,
    Problem as Problem,
    SpecError as SpecError,
    UnreadableError as UnreadableError,
)
from ._expression import Element as Element, Expression as Expression, parse as parse
from ._layout import Layout as Layout, layout as layout
from ._plan import Plan as Plan, plan as plan
from ._rules import (
    Match as Match,
    Rule as Rule,
    Rules as Rules,
    UnusedRuleWarning as UnusedRuleWarning,
    dump as dump,
    load as load,
    schema as schema,
)
from ._shard import constrain as constrain, shard as shard
from ._sharding import sharding as sharding
from ._spec import FROM_FIELDS as FROM_FIELDS, field as field, spec as spec

try:
    __version__ = importlib.metadata.version("eqshard")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0+unknown"
