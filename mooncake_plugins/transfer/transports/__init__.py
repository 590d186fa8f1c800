"""Transports move one slice between local memory and a peer; the engine picks them per
peer and memory kind from what each declares (``base.Transport``), through the registry."""

from ...transport_table import register_transport, transport_names, unregister_transport
from ..segment import CUDA, HOST, kind_of_location
from .base import Transport
from .registry import build_transport, get_transport, rank, transport_class

__all__ = ["CUDA", "HOST", "Transport", "build_transport", "get_transport", "kind_of_location",
           "rank", "register_transport", "transport_class", "transport_names",
           "unregister_transport"]
