"""``python -m speedtronic`` is the ``speedtronic`` command."""

import sys

from .cli import main

sys.exit(main())
