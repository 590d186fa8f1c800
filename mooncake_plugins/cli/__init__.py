"""Command-line entry points: argparse and wiring only."""
