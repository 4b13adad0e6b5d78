"""The heal transport alone, against torchft's HTTP transport and a raw TCP copy, side by side.

    python -m bench.heal --state-gb 0.5 2 [--tensor-mib 64] [--repeats 2]

A serving process holds a state dict of fp32 tensors (``--tensor-mib`` each, ``--state-gb`` in
all) and serves it; a fetching process, started fresh for each fetch, receives it and reports the
time and how far its peak memory rose above the state's own size. Three ways, in turn, in the
same run:

- ``stream``: this project's transport (``trainer/heal_transport.py``: JSON header, raw tensor
  bytes into preallocated tensors, a CRC-32 per tensor checked on arrival);
- ``torchft-http``: torchft's ``HTTPTransport`` (``torch.save`` of the whole state on the way
  out, ``torch.load`` on the way in), which this project used before;
- ``raw-tcp``: the same tensors' bytes over one TCP connection, from their memory into tensors
  allocated as they arrive and kept (as a transport keeps them), nothing else: what the
  machine's loopback and fresh memory allow from Python.

Writes ``bench/results/heal-*.json``; the README's numbers for heal throughput come from there.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import socket
import statistics
import time
from datetime import timedelta

from bench.common import write_result

TIMEOUT = timedelta(seconds=600)
WAYS = ("stream", "torchft-http", "raw-tcp")


def make_state(state_gb: float, tensor_mib: int) -> dict:
    import torch

    count = max(1, round(state_gb * 1024 / tensor_mib))
    return {"user": {"model": {f"w{i}": torch.full((tensor_mib * 2**20 // 4,), float(i)) for i in range(count)}},
            "torchft": {"step": 1}}


def serve(way: str, state_gb: float, tensor_mib: int, ready: mp.Queue, stop: mp.Event) -> None:
    """Hold the state and serve it the given way until ``stop``; put its address on ``ready``."""
    state = make_state(state_gb, tensor_mib)
    if way == "raw-tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        ready.put(f"127.0.0.1:{listener.getsockname()[1]}")
        listener.settimeout(1.0)
        tensors = list(state["user"]["model"].values())
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                for t in tensors:
                    conn.sendall(memoryview(t.numpy()).cast("B"))
        return
    if way == "stream":
        from trainer.heal_transport import StreamTransport

        transport = StreamTransport(TIMEOUT, "127.0.0.1")
    else:
        from torchft.checkpointing import HTTPTransport

        transport = HTTPTransport(TIMEOUT, num_chunks=0)
    transport.send_checkpoint([1], 1, state, TIMEOUT)
    address = transport.metadata()
    ready.put(address.replace(address.split("//")[1].split(":")[0], "127.0.0.1", 1) if way != "stream" else address)
    stop.wait()
    transport.shutdown(wait=False)


def fetch(way: str, address: str, state_gb: float, tensor_mib: int, out: mp.Queue) -> None:
    """Fetch once; put (seconds, bytes received, peak memory above the state's size)."""
    import torch

    count = max(1, round(state_gb * 1024 / tensor_mib))
    nbytes = count * tensor_mib * 2**20
    transport = None
    if way == "stream":
        from trainer.heal_transport import StreamTransport

        transport = StreamTransport(TIMEOUT, "127.0.0.1")
    elif way == "torchft-http":
        from torchft.checkpointing import HTTPTransport

        transport = HTTPTransport(TIMEOUT, num_chunks=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if transport is not None:
        transport.recv_checkpoint(0, address, 1, TIMEOUT)
    else:
        host, port = address.split(":")
        received = []  # kept, as a transport keeps what it receives: fresh memory, not one reused tensor
        with socket.create_connection((host, int(port))) as conn:
            for _ in range(count):
                received.append(torch.empty(tensor_mib * 2**20 // 4))
                view, got = memoryview(received[-1].numpy()).cast("B"), 0
                while got < len(view):
                    got += conn.recv_into(view[got:])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    if transport is not None:
        transport.shutdown(wait=False)
    out.put((seconds, nbytes, max(0, peak - nbytes)))


def measure(way: str, state_gb: float, tensor_mib: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(way, state_gb, tensor_mib, ready, stop), daemon=True)
    server.start()
    try:
        address = ready.get(timeout=300)
        runs = []
        for _ in range(repeats):
            client = ctx.Process(target=fetch, args=(way, address, state_gb, tensor_mib, out))
            client.start()
            seconds, nbytes, extra = out.get(timeout=600)
            client.join()
            runs.append({"seconds": seconds, "gib_per_s": nbytes / 2**30 / seconds, "extra_bytes": extra})
    finally:
        stop.set()
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
    best = statistics.median(r["gib_per_s"] for r in runs)
    return {"way": way, "state_gb": state_gb, "runs": runs, "gib_per_s": best,
            "extra_of_state": statistics.median(r["extra_bytes"] for r in runs) / (state_gb * 2**30)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-gb", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = []
    for state_gb in args.state_gb:
        row = {way: measure(way, state_gb, args.tensor_mib, args.repeats) for way in WAYS}
        raw = row["raw-tcp"]["gib_per_s"]
        for way in WAYS:
            r = row[way]
            print(f"{state_gb:>5g} GiB  {way:<13} {r['gib_per_s']:5.2f} GiB/s  {r['gib_per_s'] / raw:6.1%} of raw TCP  "
                  f"peak memory +{r['extra_of_state']:.0%} of the state", flush=True)
            results.append({**r, "of_raw_tcp": r["gib_per_s"] / raw})
    write_result("heal", vars(args), runs=results)


if __name__ == "__main__":
    main()
