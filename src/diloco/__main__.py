"""`python -m diloco ...` is the `diloco` command (torchrun launches modules this way)."""

import sys

from diloco.cli.main import main

sys.exit(main())
