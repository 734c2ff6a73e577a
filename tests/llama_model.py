"""The Llama-3-8B-shaped model of `examples/llama_8b.py` (real `eqx.nn` modules, its
32 layers stacked), only ever built abstractly, and its spec `LLAMA_SPEC`, for the
tests; imported from the example by its path, under the module name `llama_8b`."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).parent.parent / "examples" / "llama_8b.py"
if "llama_8b" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("llama_8b", _PATH)
    assert _spec is not None
    assert _spec.loader is not None
    sys.modules["llama_8b"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["llama_8b"])

from llama_8b import (  # noqa: E402
    COLUMNS,
    DIM,
    HIDDEN,
    LAYERS,
    LLAMA_SPEC,
    ROWS,
    VOCAB,
    Llama,
    build,
)

__all__ = ["COLUMNS", "DIM", "HIDDEN", "LAYERS", "LLAMA_SPEC", "ROWS", "VOCAB", "Llama", "build"]
