"""``python -m leantrain`` is the ``leantrain`` command."""

import sys

from leantrain.entry import main

sys.exit(main())
