"""The heal transport alone, against torchft's HTTP transport and a raw TCP copy, side by side.

    python -m bench.heal --state-gb 0.5 2 4 [--sources 1 2] [--tensor-mib 64] [--repeats 2]
    python -m bench.heal --state-gb 0.5 --sources 1 2 3 --link-mbit 800     # root: shaped links
    python -m bench.heal --state-gb 2 --ways raw-tcp torchft-pg stream --sources 1

Serving processes hold a state dict of fp32 tensors (``--tensor-mib`` each, ``--state-gb`` in
all) and serve it; a fetching process, started fresh for each fetch, receives it and reports the
time and how far its peak memory rose beyond the state. In turn, in the same run:

- ``torchft-http``: torchft's ``HTTPTransport`` (``torch.save`` of the whole state on the way
  out, ``torch.load`` on the way in), which this project used before;
- ``torchft-pg``: torchft's ``PGTransport`` (a pickled header, then each tensor sent over a gloo
  process group between the two, received in place when given the receiver's state);
- ``raw-tcp``: the same tensors' bytes over one TCP connection from their memory, nothing else:
  what the machine allows from Python;
- ``stream×N``: this project's transport (``trainer/heal_transport.py``: JSON header, raw tensor
  bytes, a CRC-32C per segment checked on arrival), striped over N serving processes.

The raw copy and the stream receive twice: into fresh memory (``fresh``: what a transport that
allocates pays to fault it in), and ``in place``, into the receiver's own state already in
memory, where a trainer's heal lands (``StreamTransport.destination``); each is compared with the
raw copy of the same kind, and striping (``--sources``, in place) with one source.

On loopback every byte costs a copy on both ends, so sources and receiver share this machine's
cores. ``--link-mbit R`` (root, iproute2) puts the receiver and each source on a host of its own
(network namespaces, ``tests/netns.py``), each source's link shaped to R Mbit/s (``tc tbf``), as
peers on other machines are: there the link, not the CPU, bounds a source.

Writes ``bench/results/heal-*.json``; the heal throughput in the docs comes from there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

from bench.common import REPO, write_result

TIMEOUT = timedelta(seconds=600)
WAYS = ("torchft-http", "torchft-pg", "raw-tcp", "stream")


def make_state(state_gb: float, tensor_mib: int) -> dict:
    import torch

    count = max(1, round(state_gb * 1024 / tensor_mib))
    return {"user": {"model": {f"w{i}": torch.full((tensor_mib * 2**20 // 4,), float(i)) for i in range(count)}},
            "torchft": {"step": 1}}


def serve(way: str, state_gb: float, tensor_mib: int, host: str) -> None:
    """Hold the state and serve it the given way on ``host``; print the address; serve until
    stdin closes."""
    state = make_state(state_gb, tensor_mib)
    if way == "raw-tcp":
        listener = socket.create_server((host, 0))
        print(f"{host}:{listener.getsockname()[1]}", flush=True)
        tensors = list(state["user"]["model"].values())

        def answer() -> None:
            while True:
                conn, _ = listener.accept()
                with conn:
                    for t in tensors:
                        conn.sendall(memoryview(t.numpy()).cast("B"))

        threading.Thread(target=answer, daemon=True).start()
    elif way == "torchft-pg":
        import torch
        import torch.distributed as dist
        from torchft import ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        print(f"{host}:{store.port}", flush=True)
        for line in sys.stdin:  # one fetch each: its process group's prefix
            pg = ProcessGroupGloo(timeout=TIMEOUT)
            pg.configure(f"{host}:{store.port}/{line.strip()}", "source", 0, 2)
            PGTransport(pg, TIMEOUT, torch.device("cpu")).send_checkpoint([1], 1, state, TIMEOUT)
        return
    else:
        if way == "stream":
            from trainer.heal_transport import StreamTransport

            transport = StreamTransport(TIMEOUT, host)
        else:
            from torchft.checkpointing import HTTPTransport

            transport = HTTPTransport(TIMEOUT, num_chunks=0)
        transport.send_checkpoint([1], 1, state, TIMEOUT)
        address = transport.metadata()
        print(address if way == "stream" else address.replace(address.split("//")[1].split(":")[0], host, 1),
              flush=True)
    sys.stdin.read()


def fetch(way: str, state_gb: float, tensor_mib: int, in_place: bool, host: str, addresses: list[str]) -> None:
    """Fetch once (striped over ``addresses`` for the stream); print seconds, bytes, peak memory
    beyond the state, and the bytes each source sent, as JSON."""
    import torch

    count = max(1, round(state_gb * 1024 / tensor_mib))
    nbytes = count * tensor_mib * 2**20
    own = make_state(state_gb, tensor_mib) if in_place else None
    transport = None
    if way == "stream":
        from trainer.heal_transport import StreamTransport

        transport = StreamTransport(TIMEOUT, host, peers=lambda step: addresses[1:])
        transport.destination = (lambda: own) if in_place else None
    elif way == "torchft-http":
        from torchft.checkpointing import HTTPTransport

        transport = HTTPTransport(TIMEOUT, num_chunks=0)
    elif way == "torchft-pg":
        from torchft import ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        pg.configure(addresses[0], "healing", 1, 2)
        transport = PGTransport(pg, TIMEOUT, torch.device("cpu"), state_dict=(lambda: own) if in_place else None)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if transport is not None:
        transport.recv_checkpoint(0, addresses[0], 1, TIMEOUT)
    else:
        host, port = addresses[0].split(":")
        received = []  # kept, as a transport keeps what it receives: fresh memory, not one reused tensor
        with socket.create_connection((host, int(port))) as conn:
            for i in range(count):
                received.append(own["user"]["model"][f"w{i}"] if in_place else torch.empty(tensor_mib * 2**20 // 4))
                view, got = memoryview(received[-1].numpy()).cast("B"), 0
                while got < len(view):
                    got += conn.recv_into(view[got:])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    by_source = dict(transport.last_fetch.by_source) if way == "stream" else {addresses[0]: nbytes}
    if way == "stream" and in_place and transport.last_fetch.in_place_bytes != nbytes:
        raise SystemExit("the heal did not land in the receiver's own state")
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "extra_bytes": max(0, peak - (0 if in_place else nbytes)),
                      "by_source": by_source}), flush=True)


class Hosts:
    """Where the processes run: all on loopback, or (``link_mbit``) the receiver on host 0 and
    source i on host i, each source's link shaped."""

    def __init__(self, sources: int, link_mbit: int | None):
        self.link_mbit = link_mbit
        self.net = None
        if link_mbit is not None:
            from tests.netns import NamespaceHosts

            self.net = NamespaceHosts(1 + sources)

    def __enter__(self) -> "Hosts":
        if self.net is not None:
            self.net.__enter__()
            for i in range(1, self.net.count):
                self.net.shape(i, self.link_mbit)
        return self

    def __exit__(self, *exc) -> None:
        if self.net is not None:
            self.net.__exit__(*exc)

    def address(self, i: int) -> str:
        return "127.0.0.1" if self.net is None else self.net.address(i)

    def run(self, i: int) -> list[str]:
        return [] if self.net is None else self.net.run(i)


def _role(hosts: Hosts, i: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*hosts.run(i), sys.executable, "-m", "bench.heal", *args], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})


def measure(way: str, state_gb: float, args, sources: int = 1, in_place: bool = False) -> dict:
    with Hosts(sources, args.link_mbit) as hosts, contextlib.ExitStack() as stack:
        servers = [_role(hosts, 1 + i, "serve", way, str(state_gb), str(args.tensor_mib), hosts.address(1 + i))
                   for i in range(sources)]
        for server in servers:
            stack.callback(_end, server)
        addresses = [server.stdout.readline().strip() for server in servers]
        runs = []
        for i in range(args.repeats):
            if way == "torchft-pg":  # a process group of the two, made anew for each fetch
                servers[0].stdin.write(f"fetch{i}\n")
                servers[0].stdin.flush()
                addresses = [f"{addresses[0].split('/')[0]}/fetch{i}"]
            client = _role(hosts, 0, "fetch", way, str(state_gb), str(args.tensor_mib), str(int(in_place)),
                           hosts.address(0), *addresses)
            out, _ = client.communicate(timeout=900)
            if client.returncode:
                raise RuntimeError(f"{way} fetch failed ({client.returncode})")
            run = json.loads(out.strip().splitlines()[-1])
            runs.append({**run, "gib_per_s": run["bytes"] / 2**30 / run["seconds"]})
    return {"way": way, "sources": sources, "in_place": in_place, "state_gb": state_gb, "runs": runs,
            "gib_per_s": statistics.median(r["gib_per_s"] for r in runs),
            "extra_of_state": statistics.median(r["extra_bytes"] for r in runs) / (state_gb * 2**30)}


def _end(proc: subprocess.Popen) -> None:
    """Close its stdin (it exits); SIGKILL it if it does not."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-gb", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 2],
                        help="live peers the stream stripes over, one measurement each")
    parser.add_argument("--link-mbit", type=int, help="each source on a host of its own, its link shaped to this")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=["torchft-http", "raw-tcp", "stream"],
                        help="what to measure (raw-tcp is the reference of the others)")
    args = parser.parse_args()
    results = []
    for state_gb in args.state_gb:
        row = [measure("torchft-http", state_gb, args)] if "torchft-http" in args.ways and not args.link_mbit else []
        for in_place in ((True,) if args.link_mbit else (False, True)):
            row.append(measure("raw-tcp", state_gb, args, in_place=in_place))
            if "torchft-pg" in args.ways and not args.link_mbit:
                row.append(measure("torchft-pg", state_gb, args, in_place=in_place))
            if "stream" in args.ways:
                row += [measure("stream", state_gb, args, n, in_place) for n in (args.sources if in_place else [1])]
        for r in row:
            raw = next(x["gib_per_s"] for x in row if x["way"] == "raw-tcp" and x["in_place"] == r["in_place"])
            one = next((x["gib_per_s"] for x in row if x["way"] == r["way"] and x["in_place"] == r["in_place"]
                        and x["sources"] == 1), r["gib_per_s"])
            name = (f"stream×{r['sources']}" if r["way"] == "stream" else r["way"]) + (" in place" if r["in_place"] else "")
            r = {**r, "of_raw_tcp": r["gib_per_s"] / raw, "of_one_source": r["gib_per_s"] / one}
            print(f"{state_gb:>5g} GiB  {name:<22} {r['gib_per_s']:5.2f} GiB/s  {r['of_raw_tcp']:6.1%} of raw TCP  "
                  f"peak memory +{r['extra_of_state']:.0%} of the state"
                  + (f"  {r['of_one_source']:.2f}× one source" if r["sources"] > 1 else ""), flush=True)
            results.append(r)
    print(f"wrote {write_result('heal', vars(args), runs=results).relative_to(REPO)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1:2] == ["fetch"]:
        fetch(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6], sys.argv[7:])
    else:
        main()
