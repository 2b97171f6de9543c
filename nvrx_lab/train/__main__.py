"""``python -m nvrx_lab.train``: see :mod:`nvrx_lab.train.main`."""

import sys

from nvrx_lab.train.main import main

sys.exit(main())
