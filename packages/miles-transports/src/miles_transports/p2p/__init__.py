"""Peer-to-peer weight transport over Mooncake's TransferEngine (entry point ``p2p``).

- :mod:`miles_transports.p2p.plan`: which engines each trainer rank writes to.
- :mod:`miles_transports.p2p.transport`: :class:`P2PTransport`, the trainer side.

The engine side (the ``p2p`` engine receiver, mounted by the embedded engine) is
:mod:`miles_transports.p2p.receiver` (the receive buffer) and :mod:`miles_transports.p2p.routes`
(``/p2p/init``, ``/p2p/apply``, ``/p2p/close``).
Mooncake is imported only when a transport connects: install the extra
``miles-transports[p2p]`` (CPU, tcp) or ``miles-transports[p2p-cuda]`` (CUDA, rdma).
"""

from miles_transports.p2p.plan import plan_transfers
from miles_transports.p2p.transport import P2PTransport

__all__ = ["P2PTransport", "plan_transfers"]
