"""One member of a cross-group gloo process group, for tests/test_fault_tolerance.py.

    python tests/gloo_member.py RANK WORLD STORE_PORT MODE

All members all-reduce once. Then, with MODE ``abandon``, rank 1 leaves the next all-reduce
(as a group does after its own error) and ends its connections while something still holds
its process group; the others all-reduce and print how long it took them to fail. With MODE
``keys``, rank 0 prints how many keys the group left in the store.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions, ReduceOp

from trainer.fault_tolerance import AbortableProcessGroupGloo

rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)
keys_before = store.num_keys()
pg = AbortableProcessGroupGloo(timeout=timedelta(seconds=10))
pg.configure(f"127.0.0.1:{port}/torchft/1/0", f"member{rank}", rank, world)
opts = AllreduceOptions()
opts.reduceOp = ReduceOp.SUM
tensor = torch.ones(1000)
pg.allreduce([tensor], opts).wait()
print(f"ready {rank}", flush=True)
if mode == "keys":
    pg.allreduce([tensor], opts).wait()  # every member is past its configure
    if rank == 0:
        print(f"keys left {store.num_keys() - keys_before}", flush=True)
elif rank == 1:
    held = pg._pg  # an in-flight work holds the group the same way
    time.sleep(0.5)
    pg.end_connections()
else:
    start = time.monotonic()
    try:
        pg.allreduce([tensor], opts).wait()
        print("completed", flush=True)
    except RuntimeError as err:
        print(f"failed after {time.monotonic() - start:.2f} s: {str(err)[:60]}", flush=True)
time.sleep(1)
