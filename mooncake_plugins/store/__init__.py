"""Mooncake Store: master service, client, allocation, eviction, HA and SSD offload."""
