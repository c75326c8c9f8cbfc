"""One TCP stream between two hosts: ``recv ADDR PORT N`` prints the rate it received N bytes
at (bytes/s, from the first byte to the last); ``send ADDR PORT N`` connects (retrying until
the receiver listens) and sends N bytes. ``serve ADDR PORT N`` answers each byte it reads with
N bytes; ``ask ADDR PORT N K`` asks it K times, each time after the link idled 0.1 s, and
prints the shortest wait for an answer (seconds)."""

import socket
import sys
import time

mode, addr, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def connect() -> socket.socket:
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.create_connection((addr, port))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


if mode == "serve":
    with socket.create_server((addr, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        answer = bytes(nbytes)
        while conn.recv(1):
            conn.sendall(answer)
elif mode == "ask":
    conn = connect()
    waits = []
    for _ in range(int(sys.argv[5])):
        time.sleep(0.1)  # the link idles: a token bucket refills
        start = time.perf_counter()
        conn.sendall(b"?")
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 20))
        waits.append(time.perf_counter() - start)
    conn.close()
    print(min(waits), flush=True)
elif mode == "recv":
    with socket.create_server((addr, port)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        got, first = 0, None
        while got < nbytes:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            first = first or time.perf_counter()
            got += len(chunk)
        print(got / (time.perf_counter() - first), flush=True)
else:
    conn = connect()
    block = bytes(1 << 20)
    for start in range(0, nbytes, len(block)):
        conn.sendall(block[: nbytes - start])
    conn.close()
