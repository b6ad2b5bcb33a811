"""`python -m cluster <command>`: plan, build-model, bench, run (the commands are `cluster.cli.main`)."""

import sys

from cluster.cli.main import main

sys.exit(main())
