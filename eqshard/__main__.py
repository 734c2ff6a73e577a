"""`python -m eqshard`: the same as the `eqshard` command."""

import sys

from ._cli._main import main

if __name__ == "__main__":
    sys.exit(main())
