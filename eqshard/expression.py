"""The expression language and its layouts, one array at a time.

`parse` reads an einshard expression; `layout` says which block of an array each
device holds, with no devices needed; `sharding` turns an expression into the
`NamedSharding` JAX places by. Models are laid out by `eqshard.plan` and
`eqshard.apply`, which use these.

```python
from eqshard.expression import layout, parse

expr = parse("x y -> x y*")
layout(expr, (4, 8), 2).blocks   # device 0 holds columns 0-3, device 1 columns 4-7
```
"""

from ._expression import Element as Element, Expression as Expression, parse as parse
from ._layout import Layout as Layout, layout as layout
from ._sharding import Devices as Devices, sharding as sharding

__all__ = ["Devices", "Element", "Expression", "Layout", "layout", "parse", "sharding"]
