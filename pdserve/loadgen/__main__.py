"""`python -m pdserve.loadgen ...`: the same as `pdserve bench ...`."""

import sys

from pdserve.loadgen.cli import main

sys.exit(main())
