"""Specs tested in the user's own CI: equivalence and golden layouts.

**Example:**

```python
from pathlib import Path
from eqshard.testing import assert_equivalent, assert_layouts

SPEC = Path("specs/model.eqshard.json")

def test_spec_is_equivalent():
    assert_equivalent(mypkg.model.build, SPEC, mypkg.model.loss, mypkg.model.batch,
                      device_counts=(1, 2, 8), optimizer=mypkg.model.optimizer)

def test_spec_layouts():
    assert_layouts(mypkg.model.build, SPEC,
                   golden="tests/golden/model.json", device_counts=(8, 64))
```

Each device count runs in a process of its own, with that many simulated CPU devices. So
this module starts no JAX backend in the test process. The pytest plugin is registered
on install; `-p no:eqshard` turns it off. It adds `--eqshard-update`, which rewrites
golden files.
"""

from ._equivalence import (
    COLLECTIVE_KINDS as COLLECTIVE_KINDS,
    assert_equivalent as assert_equivalent,
)
from ._golden import assert_layouts as assert_layouts
from ._tolerances import TOLERANCES as TOLERANCES

__all__ = ["COLLECTIVE_KINDS", "TOLERANCES", "assert_equivalent", "assert_layouts"]
