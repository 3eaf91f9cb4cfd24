"""The peer side of scripts/bench/elastic.sh: a minimal torch.distributed (gloo) worker for
torchrun's elastic mode. It prints `FIRST_STEP <unix time> restart=<n> world=<w>` after its
first all-reduce, then all-reduces every 10 ms until stopped: the time from a node's death to
that line of the re-formed group is torchrun's re-forming time, without any model or data to
load (a lower bound for a real job)."""
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(
    f"FIRST_STEP {time.time():.3f} restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
    f"world={dist.get_world_size()}",
    flush=True,
)
while True:
    dist.all_reduce(t)
    time.sleep(0.01)
