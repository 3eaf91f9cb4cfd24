#!/usr/bin/env bash
# All-reduce bandwidth, 2 ranks on this machine, f32, 1 / 16 / 64 / 256 MiB:
# our `tcp` backend (target/release/collective-bench) against PyTorch's gloo backend, both
# started by `launch` in the same script run (the launcher is not in the timed region).
# Prints median time and algorithm bandwidth (bytes / time; for 2 ranks the bus bandwidth is
# the same), and the single-thread memcpy bandwidth of the machine (the intra-host ceiling).
#
# Usage: scripts/bench/allreduce.sh [SIZE_MIB ...]
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >/dev/null
cargo build --release -p gptrec-launcher -p gptrec-worker >/dev/null 2>&1 || cargo build --release -p gptrec-launcher -p gptrec-worker
sizes="${*:-1 16 64 256}"
launch=target/release/launch

echo "== ours: tcp ring (2 ranks)"
"$launch" --num-processes 2 --master-port 0 -- target/release/collective-bench $sizes 2>&1 | sed -n -E 's/^\[rank 0\] ((tcp|gloo|memcpy) .*)/\1/p'

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/gloo_bench.py" <<'PY'
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for mib in [int(s) for s in sys.argv[1:]]:
    t = torch.ones((mib << 20) // 4, dtype=torch.float32)
    iters = 5 if mib >= 256 else 10 if mib >= 64 else 20
    times = []
    for i in range(iters + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        if i >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    if rank == 0:
        print(f"gloo {mib} MiB: median {median*1e3:.1f} ms, {mib/1024/median:.2f} GiB/s (algorithm bandwidth, {world} ranks, {iters} runs)", flush=True)
dist.destroy_process_group()
PY
echo "== PyTorch $(python -c 'import torch; print(torch.__version__)' 2>/dev/null) gloo (2 ranks)"
"$launch" --num-processes 2 --master-port 0 -- python "$tmp/gloo_bench.py" $sizes 2>&1 | sed -n -E 's/^\[rank 0\] ((tcp|gloo|memcpy) .*)/\1/p'
