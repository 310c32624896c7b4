#!/usr/bin/env python
"""Join a swarm as one learning unit: same as ``p2p-diloco join [flags]`` (see ``--help``)."""

import sys

import p2p_diloco.cli

if __name__ == "__main__":
    sys.exit(p2p_diloco.cli.main(["join", *sys.argv[1:]]))
