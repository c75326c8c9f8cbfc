"""Communication at the bottom of distml: collectives over the default process group and the
accounting of the bytes each one moves."""
