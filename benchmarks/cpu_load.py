"""Keep CPU cores busy, to run the test suite as it runs on a loaded CI machine.

Timing races (a heartbeat that arrives late, a poll that loses the lock) show up far more often
when the tests do not have the machine to themselves. Each busy core is one process spinning
on arithmetic; it uses no memory, touches no file and stops on SIGINT/SIGTERM, after
``--seconds``, or when the script (or the launcher that started it) is killed.

    python benchmarks/cpu_load.py --cores 1 &
    python -m pytest tests/tune -q
    kill %1

    python benchmarks/cpu_load.py --cores 2 --seconds 60   # two cores, for one minute
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time


def spin(deadline: float | None, parent: int) -> None:
    """Busy-loop on integer arithmetic until ``deadline`` (``time.monotonic()``), or for ever;
    stop as well once ``parent`` is gone, so that a SIGKILLed script leaves no core busy."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # not the parent's handlers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    x = 0
    while (deadline is None or time.monotonic() < deadline) and os.getppid() == parent:
        for _ in range(100_000):
            x = (x * 1_103_515_245 + 12_345) & 0xFFFFFFFF


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=1, help="cores to keep busy (default 1)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: until killed)"
    )
    args = parser.parse_args(argv)
    if args.cores < 1:
        parser.error(f"--cores must be at least 1, got {args.cores}")
    if args.seconds is not None and args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    deadline = None if args.seconds is None else time.monotonic() + args.seconds
    parent = os.getppid()
    procs = [
        multiprocessing.Process(target=spin, args=(deadline, os.getpid()), daemon=True)
        for _ in range(args.cores)
    ]

    def stop(_signum: int = 0, _frame: object = None) -> None:
        for proc in procs:
            if proc.pid is not None:
                proc.terminate()
                proc.join()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for proc in procs:
        proc.start()
    print(f"cpu_load: {args.cores} core(s) busy, pid {os.getpid()}", flush=True)
    # A launcher that is not this process (a pyenv shim, a shell wrapper) may be the one killed:
    # once it is gone, so is the load.
    while any(proc.is_alive() for proc in procs):
        if os.getppid() != parent:
            stop()
        procs[0].join(timeout=0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
