"""``python -m pd.tools.doctor``: the same as ``pdserve doctor``."""

import sys

from .cli import main

sys.exit(main())
