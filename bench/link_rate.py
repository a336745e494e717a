#!/usr/bin/env python3
"""The rate and round trip of a link between two test hosts, over plain TCP (W13's check).

  link_rate.py serve PORT                 answers one connection at a time, forever: a sink that
                                          acknowledges the byte count it read, or an echo
  link_rate.py send HOST PORT MEGABYTES   sends that many MB; prints {"mbit_per_s": …}
  link_rate.py ping HOST PORT COUNT       round trips of one byte; prints {"round_trip_us": median}

The sender times from its first byte to the sink's acknowledgement of the last, so the figure is
what the link carried, not what the sender's socket buffer took in.
"""
import json
import socket
import statistics
import sys
import time


def serve(port):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(4)
    print("listening", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kind = conn.recv(1)
            if kind == b"S":
                total = 0
                while True:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    total += len(chunk)
                conn.sendall(str(total).encode())
            elif kind == b"E":
                while True:
                    byte = conn.recv(1)
                    if not byte:
                        break
                    conn.sendall(byte)


def connect(host, port):
    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.create_connection((host, port), timeout=30)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def send(host, port, megabytes):
    total = int(megabytes * 1e6)
    block = b"\0" * (1 << 20)
    s = connect(host, port)
    s.sendall(b"S")
    start = time.monotonic()
    left = total
    while left > 0:
        n = min(left, len(block))
        s.sendall(block[:n])
        left -= n
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while True:
        chunk = s.recv(64)
        if not chunk:
            break
        reply += chunk
    seconds = time.monotonic() - start
    assert int(reply) == total, f"the sink read {reply!r} bytes of {total}"
    print(json.dumps({"bytes": total, "seconds": round(seconds, 4), "mbit_per_s": round(total * 8 / seconds / 1e6, 1)}))


def ping(host, port, count):
    s = connect(host, port)
    s.sendall(b"E")
    times = []
    for _ in range(count):
        start = time.monotonic()
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        times.append((time.monotonic() - start) * 1e6)
    s.close()
    print(json.dumps({"round_trip_us": round(statistics.median(times), 1)}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) == 5 and sys.argv[1] == "ping":
        ping(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(__doc__)
