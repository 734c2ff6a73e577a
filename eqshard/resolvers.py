"""Writing a spec source of your own: the resolver protocol.

Every spec source (field annotations, spec trees, `Rules`, `FSDP`) answers
`__eqshard_resolve__(model, target)` with a `Resolution`: one spec leaf per array
leaf, and the problems found. An object of yours that does the same is a spec.

```python
import jax
from eqshard.resolvers import Resolution, Target

class Columns:
    def __eqshard_resolve__(self, model, target: Target) -> Resolution:
        leaves = jax.tree_util.tree_leaves(model)
        return Resolution(["... o i -> ... o i*"] * len(leaves))
```
"""

from ._fields import FROM_FIELDS as FROM_FIELDS
from ._problems import Problem as Problem
from ._protocol import (
    Resolution as Resolution,
    Resolver as Resolver,
    SpecLeaf as SpecLeaf,
    Target as Target,
)
from ._rules import Match as Match
from ._warnings import UnusedRule as UnusedRule

__all__ = [
    "FROM_FIELDS",
    "Match",
    "Problem",
    "Resolution",
    "Resolver",
    "SpecLeaf",
    "Target",
    "UnusedRule",
]
