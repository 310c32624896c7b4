"""p2p_diloco: peer-to-peer, fault-tolerant, low-bandwidth decoupled DiLoCo training on hivemind.

Entry point: the ``p2p-diloco`` command (:mod:`p2p_diloco.cli`). The algorithm is :mod:`p2p_diloco.diloco`;
the network seam is :mod:`p2p_diloco.averaging`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("p2p_diloco")
except PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "0+unknown"
