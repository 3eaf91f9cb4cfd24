"""The peer side of scripts/bench/host_faults.sh: a minimal torch.distributed (gloo) worker for
torchrun's elastic mode, with the collective timeout our jobs get (`dist.timeout_s`, from
PEER_TIMEOUT_S). It prints `FIRST_STEP <unix time> restart=<n> world=<w>` after its first
all-reduce, then all-reduces a small tensor every 5 ms until stopped: the time from a fault to
that line of the re-formed group is torchrun's re-forming time, with no model or data to load."""
import datetime
import os
import time

import torch
import torch.distributed as dist

timeout = datetime.timedelta(seconds=float(os.environ.get("PEER_TIMEOUT_S", "8")))
dist.init_process_group("gloo", timeout=timeout)
t = torch.ones(1024)
dist.all_reduce(t)
# One write, so that the ranks' lines never interleave in the agent's output.
os.write(
    1,
    f"FIRST_STEP {time.time():.3f} restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
    f"world={dist.get_world_size()}\n".encode(),
)
while True:
    dist.all_reduce(t)
    time.sleep(0.005)
