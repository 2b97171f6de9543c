"""Peak RSS of one trainer rank: ``nvrx_lab.train.main(argv)``, then one JSON line with this
rank's ``ru_maxrss``. Run it as torchrun's script to compare a run with in-process restarts to a
fault-free one (the same argv minus ``--faults``)::

    python -m torch.distributed.run --nproc-per-node 2 tests/workers/inprocess_rss.py \\
        --restart inprocess --faults 1:4:exception,1:8:exception --dim 512 --n-layers 8 --steps 12 --log-every 0
"""

import json
import os
import resource
import sys

from nvrx_lab.train import main

if __name__ == "__main__":
    rc = main(sys.argv[1:])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row = {"rank": int(os.environ.get("RANK", 0)), "rc": rc, "maxrss_mb": round(peak_mb, 1)}
    os.write(1, (json.dumps(row) + "\n").encode())  # one write: the ranks share a stdout
    sys.exit(rc)
