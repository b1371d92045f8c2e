"""`python -m pagedserve ...` is the `pagedserve` command."""

import sys

from pagedserve.cli import main

sys.exit(main())
