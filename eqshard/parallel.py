"""Parallelism that lives in the model's code: pipeline stages and ring attention.

Both read the active rules (`eqshard.use`), so the same model code runs whole on one
device and split when a spec says so.

```python
from eqshard.parallel import pipeline

x = pipeline(layer, model.layers, x, microbatches=8)   # stages over the axis "stage"
```
"""

from ._pipeline import Stages as Stages, pipeline as pipeline
from ._ring_attention import ring_attention as ring_attention

__all__ = ["Stages", "pipeline", "ring_attention"]
