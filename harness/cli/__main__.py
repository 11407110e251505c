"""``python -m tritune.harness.cli`` is the ``tritune`` command (profilers wrap it this way)."""
import sys

from tritune.harness.cli import main

sys.exit(main())
