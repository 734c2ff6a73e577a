"""Hardware to cost a layout for: profiles, estimates, and ranking across targets.

`eqshard.cost(..., target="v5e:2x4")` compiles for a TPU slice through libtpu; the
profiles here turn a compiled step's figures into an estimated step time, and
`suggest_targets` ranks specs on several targets at once.

```python
from eqshard.targets import HARDWARE

HARDWARE["h100"].memory_bandwidth   # bytes/s of one chip's memory
```
"""

from ._cost._hardware import HARDWARE as HARDWARE, Estimate as Estimate, Hardware as Hardware
from ._search._what_if import (
    TargetRow as TargetRow,
    Targets as Targets,
    suggest_targets as suggest_targets,
)

__all__ = ["HARDWARE", "Estimate", "Hardware", "TargetRow", "Targets", "suggest_targets"]
