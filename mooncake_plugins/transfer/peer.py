"""A remote segment as the initiator sees it: what transports execute slices against.

Its own module so that transports import it without importing the engine (which builds
the transports through the registry): the engine depends on the transports, never the
other way round.
"""

from __future__ import annotations

import threading
from typing import Callable

from .segment import SegmentDescriptor, kind_of_location


class Peer:
    """A remote segment: its latest descriptor and how to refresh it.

    Args:
        name: the segment name it was opened under.
        descriptor: its descriptor as last fetched.
        fetch: ``fetch(host, port)`` asks the segment's own rpc port for its descriptor
            (the engine's control channel); raises SegmentNotFound/MetadataError.
    """

    def __init__(self, name: str, descriptor: SegmentDescriptor,
                 fetch: Callable[[str, int], SegmentDescriptor]) -> None:
        self.name = name
        self.descriptor = descriptor
        self._fetch = fetch
        self._lock = threading.Lock()
        self._kinds: tuple[SegmentDescriptor, frozenset[str]] | None = None

    def published_kinds(self, descriptor: SegmentDescriptor) -> frozenset[str]:
        """The memory kinds (``host``, ``cuda``) of the regions ``descriptor`` publishes,
        from their ``location``; remembered for the latest descriptor asked about."""
        cached = self._kinds
        if cached is None or cached[0] is not descriptor:
            cached = (descriptor, frozenset(kind_of_location(r.location)
                                            for r in descriptor.regions))
            self._kinds = cached
        return cached[1]

    def refresh(self) -> SegmentDescriptor:
        """Fetch the descriptor again, straight from the peer's rpc port."""
        with self._lock:
            old = self.descriptor
            self.descriptor = self._fetch(old.host, old.port)
            return self.descriptor
