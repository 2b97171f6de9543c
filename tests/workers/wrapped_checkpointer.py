"""A user's script around :mod:`nvrx_lab.demo.checkpointed_worker`, with no ``__main__`` guard on purpose: the
checkpointer's writer is forked or a clean interpreter of our own module, so nothing runs this script again."""

import sys

from nvrx_lab.demo.checkpointed_worker import main

main(sys.argv[1:])
