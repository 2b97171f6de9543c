"""Worker script for tests/test_launcher_e2e.py: the demo training loop with scheduled faults.

Run by the launcher as a script path (the way most users run torchrun), e.g.
``python -m nvrx_lab.launcher ... tests/workers/launcher_worker.py --faults 1:0:5:sigkill``;
see :mod:`nvrx_lab.demo.launcher_worker` for the flags.
"""

import sys

from nvrx_lab.demo.launcher_worker import main

if __name__ == "__main__":
    sys.exit(main())
