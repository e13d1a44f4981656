"""``python -m leantrain`` is the ``leantrain`` command."""

import sys

from leantrain.cli import main

sys.exit(main())
