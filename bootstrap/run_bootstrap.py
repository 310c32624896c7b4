#!/usr/bin/env python
"""Run a bootstrap node: same as ``p2p-diloco bootstrap [flags]`` (see ``--help``)."""

import sys

import p2p_diloco.cli

if __name__ == "__main__":
    sys.exit(p2p_diloco.cli.main(["bootstrap", *sys.argv[1:]]))
