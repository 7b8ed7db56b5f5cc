"""The ``oomkit`` console script: the Rust command line, run in this process."""

import sys


def main() -> None:
    from oomkit._native import cli_main

    sys.stdout.flush()
    sys.exit(cli_main(["oomkit", *sys.argv[1:]]))
