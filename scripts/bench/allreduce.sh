#!/usr/bin/env bash
# All-reduce latency and bandwidth, 2 ranks on this machine, f32, 64 KiB and 1 / 16 / 64 /
# 256 MiB: our `tcp` backend through shared memory (its default on one host) from a private
# tensor, from data already in its shared arena (`--shared-buffer`: where DDP flattens gradient
# buckets), and through its socket ring (`--sockets`), against PyTorch's gloo backend, all started by `launch` in the same
# script run (the launcher is not in the timed region). Prints median time and algorithm
# bandwidth (bytes / time; for 2 ranks the bus bandwidth is the same), and the single-thread
# memcpy bandwidth of the machine.
#
# Usage: scripts/bench/allreduce.sh [SIZE ...]   (SIZE: MiB, or KiB with a K suffix)
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >/dev/null
cargo build --release -p gptrec-launcher -p gptrec-worker >/dev/null 2>&1 || cargo build --release -p gptrec-launcher -p gptrec-worker
sizes="${*:-64K 1 16 64 256}"
launch=target/release/launch

filter() { sed -n -E 's/^\[rank 0\] ((shm|shm-arena|tcp|gloo|memcpy) .*)/\1/p'; }
echo "== ours: shared memory (2 ranks)"
"$launch" --num-processes 2 --master-port 0 -- target/release/collective-bench $sizes 2>&1 | filter
echo "== ours: shared memory, data in the shared arena (2 ranks)"
"$launch" --num-processes 2 --master-port 0 -- target/release/collective-bench --shared-buffer $sizes 2>&1 | filter
echo "== ours: tcp ring over loopback sockets (2 ranks)"
"$launch" --num-processes 2 --master-port 0 -- target/release/collective-bench --sockets $sizes 2>&1 | filter

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/gloo_bench.py" <<'PY'
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
def size(arg):
    return int(arg[:-1]) << 10 if arg[-1] in "kK" else int(arg) << 20
for arg in sys.argv[1:]:
    nbytes = size(arg)
    label = f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    mib = nbytes >> 20
    iters = 5 if mib >= 256 else 10 if mib >= 64 else 20 if mib >= 1 else 200
    times = []
    for i in range(iters + 2):
        t.fill_(1.0)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        if i >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    if rank == 0:
        print(f"gloo {label}: median {median*1e3:.3f} ms ({median*1e6:.0f} us), {nbytes/2**30/median:.2f} GiB/s (algorithm bandwidth, {world} ranks, {iters} runs)", flush=True)
dist.destroy_process_group()
PY
echo "== PyTorch $(python -c 'import torch; print(torch.__version__)' 2>/dev/null) gloo (2 ranks)"
"$launch" --num-processes 2 --master-port 0 -- python "$tmp/gloo_bench.py" $sizes 2>&1 | filter
