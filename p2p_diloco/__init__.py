"""p2p_diloco: peer-to-peer, fault-tolerant, low-bandwidth decoupled DiLoCo training on hivemind.

Entry points: the ``p2p-diloco`` command (:mod:`p2p_diloco.cli`) and the library API (:mod:`p2p_diloco.api`); a
unit's wiring is :mod:`p2p_diloco.peer`, its configuration :mod:`p2p_diloco.config`. The algorithm, torch only:
:mod:`p2p_diloco.diloco`, :mod:`p2p_diloco.fragments`, :mod:`p2p_diloco.streaming`, :mod:`p2p_diloco.robust`, and the
rounds (:mod:`p2p_diloco.rounds`); the unit (:mod:`p2p_diloco.unit`), the network behind one seam
(:mod:`p2p_diloco.network`; the seam's protocol is :mod:`p2p_diloco.rounds.averager`) and operations
(:mod:`p2p_diloco.ops`).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("p2p_diloco")
except PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "0+unknown"
