"""The front door: an opt-in pass-through in front of a server that sees every token it delivers,
fails stalled requests loudly and gates clients while the server restarts (docs/front-door.md)."""

from mlxwatch.front.delivery import DeliveryView, Observations, RequestView
from mlxwatch.front.door import FrontDoor, Gate

__all__ = ["DeliveryView", "FrontDoor", "Gate", "Observations", "RequestView"]
