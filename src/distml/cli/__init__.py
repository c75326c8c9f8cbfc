"""The ``distml`` command line (typer + rich)."""
