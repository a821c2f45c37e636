"""``python -m pd.tools.diagnose``: the same as ``pdserve diagnose``."""

from .cli import main

raise SystemExit(main())
