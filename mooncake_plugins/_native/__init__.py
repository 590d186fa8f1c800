"""Extension modules compiled from native/ by setup.py (generated, never edited)."""
