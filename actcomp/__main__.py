"""``python -m actcomp``: see :mod:`actcomp.tools.cli`."""

import sys

from actcomp.tools.cli import main

sys.exit(main())
