"""The ``oomkit`` console script: the Rust command line, run in this process."""

import os
import sys


def main() -> None:
    from oomkit._native import cli_main

    # The Python this oomkit is installed in, for what the command runs in
    # Python (`estimate --trace`); a venv's interpreter is a link the
    # process itself cannot tell from the one it points to.
    os.environ.setdefault("OOMKIT_PYTHON", sys.executable)
    sys.stdout.flush()
    sys.exit(cli_main(["oomkit", *sys.argv[1:]]))
