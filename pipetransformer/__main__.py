"""`python -m pipetransformer`: the `pipetransformer` command."""

import sys

from pipetransformer.orchestrator.cli import main

sys.exit(main())
