"""The original Mooncake Python API (class names, argument order, integer return codes),
as thin wrappers over our Pythonic API. ``integrations/mooncake`` re-exports these.
``structured/`` is the structured object store behind ``mooncake.structured_object_store``;
only the drop-in uses it."""
