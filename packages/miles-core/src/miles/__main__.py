"""``python -m miles`` is the ``miles`` command."""

from miles.cli import main

main()
