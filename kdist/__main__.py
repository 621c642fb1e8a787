"""``python -m kdist``: the ``kdist`` command (:mod:`kdist.cli`), where its script is not on
PATH (``kdist.cli.command`` says which to type)."""

import sys

from kdist.cli import main

sys.exit(main())
