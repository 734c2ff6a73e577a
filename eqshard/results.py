"""What eqshard's functions return: reports, costs, diffs, rankings and steps.

Each is a frozen dataclass with a `__rich__` table and a `to_json`. A training script
rarely names them; annotations and `isinstance` checks do.

```python
from eqshard.results import Cost

def budget(c: Cost) -> bool:
    return c.memory.peak is not None and c.memory.peak < 16 * 2**30
```
"""

from ._cost._results import (
    Collective as Collective,
    Cost as Cost,
    Explained as Explained,
    Explanation as Explanation,
    Memory as Memory,
)
from ._report import Report as Report
from ._search._diff import Diff as Diff, LeafChange as LeafChange
from ._search._ranked import Ranked as Ranked, Suggestion as Suggestion
from ._step import Step as Step

__all__ = [
    "Collective",
    "Cost",
    "Diff",
    "Explained",
    "Explanation",
    "LeafChange",
    "Memory",
    "Ranked",
    "Report",
    "Step",
    "Suggestion",
]
