#!/usr/bin/env bash
# Collectives of 2 ranks on this machine, f32, 64 KiB and 1 / 16 / 64 / 256 MiB: our `tcp`
# backend and PyTorch's gloo backend, all started by `launch` in the same script run (the
# launcher is not in the timed region).
#
#   all-reduce  ours through shared memory from a private tensor (`shm`), from data already in
#               its shared arena (`shm-arena`: where DDP flattens gradient buckets), the sharded
#               step's reduction that training uses on one host (`shm-sharded`: every rank's
#               gradient lies in shared memory, each rank averages its share of the rows where
#               they lie, then a barrier; `dist.shard_optimizer`), through its socket ring
#               (`tcp`); gloo
#   broadcast   from rank 0: ours through shared memory and through the socket ring; gloo
#   all-gather  SIZE per rank (bandwidth counts the gathered bytes): the same three, and ours in
#               place (each rank's part already its slot of the output, as FSDP gathers its
#               parameters with `all_gather_into_tensor`) through shared memory and the ring
#   barrier     the same three
#
# Every variant runs REPEAT times (default 5), the runs interleaved (each round runs every
# variant once); each run's figure is the median over its iterations, and each cell is the
# median of the REPEAT runs. Algorithm bandwidth = bytes / time (for 2 ranks the bus bandwidth
# is the same). Also prints the single-thread memcpy bandwidth of the machine.
#
# Usage: [REPEAT=5] scripts/bench/allreduce.sh [SIZE ...]   (SIZE: MiB, or KiB with a K suffix)
set -eu
cd "$(dirname "$0")/../.."
. scripts/setup.sh >&2 # its lines (a first install of torch, about 4 GB) on stderr, the figures on stdout
cargo build --release -p gptrec-launcher -p gptrec-worker >/dev/null 2>&1 || cargo build --release -p gptrec-launcher -p gptrec-worker
sizes="${*:-64K 1 16 64 256}"
repeat="${REPEAT:-5}"
launch=target/release/launch
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

cat >"$tmp/gloo_bench.py" <<'PY'
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
op = sys.argv[1]
def size(arg):
    return int(arg[:-1]) << 10 if arg[-1] in "kK" else int(arg) << 20
def label(nbytes):
    return f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
if op == "barrier":
    times = []
    for _ in range(1000):
        start = time.perf_counter()
        dist.barrier()
        times.append(time.perf_counter() - start)
    times.sort()
    if rank == 0:
        print(f"gloo barrier: median {times[len(times) // 2]*1e6:.1f} us ({world} ranks, 1000 runs)", flush=True)
    sys.exit(0)
for arg in sys.argv[2:]:
    nbytes = size(arg)
    t = torch.full((nbytes // 4,), float(rank + 1), dtype=torch.float32)
    out = [torch.empty_like(t) for _ in range(world)]
    mib = nbytes >> 20
    iters = 5 if mib >= 256 else 10 if mib >= 64 else 20 if mib >= 1 else 200
    times = []
    for i in range(iters + 2):
        t.fill_(float(rank + 1))
        dist.barrier()
        start = time.perf_counter()
        if op == "all-reduce":
            dist.all_reduce(t)
        elif op == "broadcast":
            dist.broadcast(t, 0)
        else:
            dist.all_gather(out, t)
        if i >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    moved = nbytes * world if op == "all-gather" else nbytes
    name = "gloo" if op == "all-reduce" else f"gloo {op}"
    if rank == 0:
        print(f"{name} {label(nbytes)}: median {median*1e3:.3f} ms ({median*1e6:.0f} us), {moved/2**30/median:.2f} GiB/s (algorithm bandwidth, {world} ranks, {iters} runs)", flush=True)
dist.destroy_process_group()
PY

ours() { "$launch" --num-processes 2 --master-port 0 -- target/release/collective-bench "$@" $sizes; }
gloo() { "$launch" --num-processes 2 --master-port 0 -- python "$tmp/gloo_bench.py" "$@" $sizes; }
variants=(
  "ours" "ours --shared-buffer" "ours --op sharded-reduce" "ours --sockets" "gloo all-reduce"
  "ours --op broadcast" "ours --op broadcast --sockets" "gloo broadcast"
  "ours --op all-gather" "ours --op all-gather --sockets" "gloo all-gather"
  "ours --op all-gather --in-place" "ours --op all-gather --in-place --sockets"
  "ours --op barrier" "ours --op barrier --sockets" "gloo barrier"
)
echo "bench: $repeat interleaved rounds of ${#variants[@]} variants, sizes $sizes"
for round in $(seq "$repeat"); do
  for v in "${variants[@]}"; do
    $v 2>&1 | sed -n -E 's/^\[rank 0\] //p' >>"$tmp/lines" || { echo "failed: $v" >&2; exit 1; }
  done
done
python3 - "$tmp/lines" "$repeat" <<'PY'
import re, statistics, sys
lines = open(sys.argv[1]).read().splitlines()
repeat = sys.argv[2]
runs = {}  # (name, size) -> [seconds]
memcpy = []
for line in lines:
    m = re.match(r"memcpy 64 MiB \(one thread\): [\d.]+ ms, ([\d.]+) GiB/s", line)
    if m:
        memcpy.append(float(m.group(1)))
        continue
    m = re.match(r"(.+?) (\d+ [KM]iB): median ([\d.]+) ms", line)
    if m:
        runs.setdefault((m.group(1), m.group(2)), []).append(float(m.group(3)) / 1e3)
        continue
    m = re.match(r"(.+? barrier): median ([\d.]+) us", line)
    if m:
        runs.setdefault((m.group(1), ""), []).append(float(m.group(2)) / 1e6)
def mib(size):
    n, unit = size.split()
    return int(n) / (1024 if unit == "KiB" else 1)
def cell(name, size, gathered=False):
    times = runs.get((name, size))
    if not times:
        return "-"
    t = statistics.median(times)
    if t < 1e-5:
        text = f"{t*1e6:.1f} µs"
    elif t < 1e-3:
        text = f"{t*1e6:.0f} µs"
    else:
        text = f"{t*1e3:.2f} ms"
    if size and mib(size) >= 1:
        moved = mib(size) * (2 if gathered else 1) / 1024
        text += f", {moved / t:.2f} GiB/s"
    return text
def ratio(a, b, size):
    ta, tb = runs.get((a, size)), runs.get((b, size))
    if not ta or not tb:
        return "-"
    return f"{statistics.median(tb) / statistics.median(ta):.1f}x"
sizes = sorted({s for (_, s) in runs if s}, key=mib)
print(f"\nsingle-thread memcpy of 64 MiB: {statistics.median(memcpy):.1f} GiB/s (median of {len(memcpy)} runs)")
print(f"\nall-reduce, 2 ranks, medians of {repeat} runs")
print("| size | ours, sharded step (training) | ours, shared arena | ours, shared memory, private tensor | ours, socket ring | gloo | sharded vs gloo |")
print("|---|---|---|---|---|---|---|")
for s in sizes:
    print(f"| {s} | {cell('shm-sharded', s)} | {cell('shm-arena', s)} | {cell('shm', s)} | {cell('tcp', s)} | {cell('gloo', s)} | {ratio('shm-sharded', 'gloo', s)} |")
for op, gathered in (("broadcast", False), ("all-gather", True)):
    print(f"\n{op}, 2 ranks, medians of {repeat} runs" + (" (bandwidth: the gathered bytes)" if gathered else ""))
    extra = " in place, shared memory | in place, socket ring | in place, vs ring |" if gathered else ""
    print("| size | ours, shared memory | ours, socket ring | gloo | shared memory vs socket ring |" + extra)
    print("|---|---|---|---|---|" + ("---|---|---|" if gathered else ""))
    for s in sizes:
        a, b, g = f"shm {op}", f"tcp {op}", f"gloo {op}"
        row = f"| {s} | {cell(a, s, gathered)} | {cell(b, s, gathered)} | {cell(g, s, gathered)} | {ratio(a, b, s)} |"
        if gathered:
            ia, ib = f"shm {op} in place", f"tcp {op} in place"
            row += f" {cell(ia, s, gathered)} | {cell(ib, s, gathered)} | {ratio(ia, ib, s)} |"
        print(row)
print(f"\nbarrier, 2 ranks, medians of {repeat} runs (each a median of 1000)")
print("| ours, shared memory | ours, socket ring | gloo |")
print("|---|---|---|")
print(f"| {cell('shm barrier', '')} | {cell('tcp barrier', '')} | {cell('gloo barrier', '')} |")
PY
