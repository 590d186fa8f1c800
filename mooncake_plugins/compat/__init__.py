"""The original Mooncake Python API (class names, argument order, integer return codes),
as thin wrappers over our Pythonic API. ``integrations/mooncake`` re-exports these."""
