"""Starts the processes of a PyTorch twin with the environment contract of `accelerate launch`
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, thread counts), since
Debian's torchrun does not run on its Python; and reads a worker's memory figures."""
import os
import socket
import subprocess
import sys


def run_as_workers(worker, nproc=2, threads=None):
    """In a worker (RANK set) calls `worker()`; otherwise restarts this script as `nproc` workers
    with `threads` OpenMP/OpenBLAS threads each (default: cores / nproc, as the launcher)."""
    if "RANK" in os.environ:
        worker()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = threads or max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
        # Debian's PyTorch 2.x is built without libuv, which its TCPStore asks for by default.
        env.setdefault("USE_LIBUV", "0")
        procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
    sys.exit(max(p.wait() for p in procs))


def status_mib(field):
    """A field of /proc/self/status (VmRSS, VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0
