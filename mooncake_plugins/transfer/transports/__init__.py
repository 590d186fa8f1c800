"""Transports move one slice between local memory and a peer; the engine picks one per peer."""

from .base import Transport, get_transport, transport_names

__all__ = ["Transport", "get_transport", "transport_names"]
