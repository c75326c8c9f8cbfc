"""One TCP stream between two hosts: ``recv ADDR PORT N`` prints the rate it received N bytes
at (bytes/s, from the first byte to the last); ``send ADDR PORT N`` connects (retrying until
the receiver listens) and sends N bytes."""

import socket
import sys
import time

mode, addr, port, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "recv":
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
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection((addr, port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    block = bytes(1 << 20)
    for start in range(0, nbytes, len(block)):
        conn.sendall(block[: nbytes - start])
    conn.close()
