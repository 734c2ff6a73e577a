"""eqshard: declare, check and apply how an Equinox model is sharded.

Every array leaf of a model gets an einshard expression such as `"x y -> x y*"`,
which says how the leaf is split and replicated across the devices.
"""

import importlib.metadata

from ._errors import EqshardError as EqshardError, ExpressionError as ExpressionError
from ._expression import Element as Element, Expression as Expression, parse as parse
from ._layout import Layout as Layout, layout as layout
from ._shard import constrain as constrain, shard as shard
from ._sharding import sharding as sharding

try:
    __version__ = importlib.metadata.version("eqshard")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
    __version__ = "0+unknown"
