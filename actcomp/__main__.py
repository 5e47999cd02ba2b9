"""``python -m actcomp``: see :mod:`actcomp.cli`."""

import sys

from actcomp.cli import main

sys.exit(main())
