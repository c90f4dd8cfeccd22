"""``python -m speedtronic`` is the ``speedtronic`` command."""

from .cli import console_main

console_main()
