"""``kvclient gateway``: the reservation ledger in front of real engines.

- :mod:`.config`: what it is told, checked at start;
- :mod:`.upstream`: one engine: its pooled client, discovery, ledger and health;
- :mod:`.watch`: what the gateway sees of an engine through its ``/metrics``, and the peak
  rule failing closed when it does not see what the rule assumes;
- :mod:`.rewrite`: what changes on the way (the cap, the headers), pure;
- :mod:`.assemble`: a plain answer assembled from the stream it was asked upstream as, pure;
- :mod:`.relay`: the backend of the generation endpoint: count, route, forward, relay;
- :mod:`.progress`: a holder's progress read from its stream, pure;
- :mod:`.state`: what one gateway owns, its counters, and the discovery of its upstreams;
- :mod:`.redis_ledgers`: the gateway's side of a shared ledger in Redis (``--ledger``);
- :mod:`.tenants`: the tenants file and who a request is, pure; :mod:`.tenancy`, the
  middleware that verifies it and the class a request is granted;
- :mod:`.metrics`, :mod:`.app`, :mod:`.cli`.

It never imports the simulated engine.
"""

from .app import create_gateway_app
from .config import GatewayConfig
from .state import GatewayState

__all__ = ["GatewayConfig", "GatewayState", "create_gateway_app"]
