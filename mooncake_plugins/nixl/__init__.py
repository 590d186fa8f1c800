"""NIXL integration: our engine as a NIXL backend (``backends=["MOONCAKE"]``).

``plugin_dir`` makes a NIXL plugin directory holding our plugin beside NIXL's bundled ones;
``backend`` is what the plugin drives.
"""
