"""``python -m linattn``: see :mod:`linattn.cli`."""
from .cli import main

raise SystemExit(main())
