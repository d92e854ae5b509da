"""``python -m bootstrap`` is the same as the ``swarm-bootstrap`` console script."""

import sys

from bootstrap.cli import main

sys.exit(main())
