"""The ``distml`` command line (typer + rich).

Each command imports what it runs inside its own function: ``distml --help``, ``distml plan``
and a command refused for a bad flag start without importing torch (about 2 s to import),
and a command never pays for another's modules. That is the one reason for the imports inside
functions in this package; a test holds it (``tests/cli/test_cli.py``).
"""
