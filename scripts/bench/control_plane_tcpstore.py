"""The control-plane scale harness's PyTorch side: the traffic of `control-plane-bench` (see
store/src/bin/control_plane_bench/traffic.rs, round for round, function for function, with the
same names) against PyTorch's TCPStore (libuv server). Run by scripts/bench/control_plane.sh.

  control_plane_tcpstore.py serve
      a TCPStore server on 127.0.0.1 (a free port); prints `port P`, serves until stdin reaches
      EOF, then prints `peak_rss_kib K threads_max T rss_start_kib S` (VmHWM, the most threads
      seen by a sampler every 20 ms, VmRSS before the store started: the interpreter and torch)
  control_plane_tcpstore.py ranks --addr 127.0.0.1:P --world N --local L --first F --count C
                                  --threads T
      ranks F..F+C of an N-rank job, L per host, one TCPStore client per rank (and a second
      for each host's leader), driven by T threads (TCPStore calls release the GIL); prints the
      same line of JSON as `control-plane-bench ranks`.

How the requests map (the `ops` count is what goes on the wire):
  ours `set`/`add`   -> `set`/`add`                                      1 request each (a
                        TCPStore `set` is not answered)
  ours `get` (may be absent, does not block) -> `check([key])`          1 (TCPStore's `get`
                        blocks until the key exists)
  ours `wait(keys)` (returns the values) -> `multi_get(keys)`            2 (TCPStore waits for
                        the keys, then gets them: WAIT, then MULTI_GET)
  ours `wait(keys, 200 ms)` in decide -> `wait(keys, 200 ms)`             1, plus CANCEL_WAIT
                        when it times out; the values then cost a `multi_get` (2)
Connections: TCPStore's clients all connect from 127.0.0.1 (it cannot bind a source address,
and its server has no per-address limit); its constructor's own requests are not counted in
`ops`, as our handshake is not.
"""

import json
import os
import sys
import threading
import time
from datetime import timedelta

WAIT_TIMEOUT = timedelta(seconds=60)
# agreement.rs's VERDICT_POLL.
VERDICT_POLL = timedelta(milliseconds=200)
OK = b"ok"
SAMPLE_EVERY = 0.020


def status_value(name):
    """A numeric field of /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


# ---------------------------------------------------------------------------------------------
# serve

def serve():
    import torch.distributed as dist

    rss_start = status_value("VmRSS")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                          wait_for_workers=False, timeout=WAIT_TIMEOUT)
    threads_max = [0]

    def sample():
        while True:
            threads_max[0] = max(threads_max[0], status_value("Threads"))
            time.sleep(SAMPLE_EVERY)

    threading.Thread(target=sample, daemon=True).start()
    print(f"port {store.port}", flush=True)
    while sys.stdin.buffer.read(65536):
        pass
    threads_max[0] = max(threads_max[0], status_value("Threads"))
    print(f"peak_rss_kib {status_value('VmHWM')} threads_max {threads_max[0]} "
          f"rss_start_kib {rss_start}", flush=True)
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# The job and the rounds (traffic.rs)

class Job:
    def __init__(self, host, port, world, local):
        self.host, self.port, self.world, self.local = host, port, world, local

    def hosts(self):
        return self.world // self.local

    def ring(self):
        return self.world > 1

    def shm_group(self, rank):
        if self.world <= 1:
            return None
        if self.hosts() <= 1:
            return range(0, self.world)
        if self.local > 1:
            base = rank - rank % self.local
            return range(base, base + self.local)
        return None

    def hierarchical(self):
        return self.hosts() > 1 and self.local > 1


class Rank:
    def __init__(self, rank):
        self.rank = rank
        self.store = None
        self.leader_store = None


class Stats:
    def __init__(self):
        self.ops = 0
        self.connects = 0
        self.max_op = 0.0
        self.max_wait = 0.0
        self.max_connect = 0.0


class RoundError(Exception):
    pass


def r1_connect_and_claim(job, me, stats):
    """`store::rendezvous` (every rank connects) and the first step of `agreement::agree`
    (`add agree/claim/<r>`; rank 0 publishes its terms, about 2 KB of JSON)."""
    rank = me.rank
    me.store = connect(job, stats)
    claim = f"agree/claim/{rank}"
    claimed = add(stats, me.store, claim, 1)
    if claimed != 1:
        raise RoundError(f"add {claim!r} gave {claimed}: the rank is taken twice")
    if rank == 0:
        set_(stats, me.store, "agree/terms/0", terms())


def r2_compare_terms(job, me, stats):
    """`agreement::agree` (`compare_with_rank0`: read rank 0's terms; publish
    `agree/rank/<r>`)."""
    rank = me.rank
    if rank != 0:
        theirs = wait(stats, me.store, ["agree/terms/0"])
        if theirs[0] != terms():
            raise RoundError("agree/terms/0 is not what rank 0 wrote")
    set_(stats, me.store, f"agree/rank/{rank}", OK)


def r3_decide(job, me, stats):
    """`agreement::decide` on rank 0: look for a verdict, wait for every rank's answer in
    200 ms windows (looking for a verdict between two), then `publish_verdict`."""
    if me.rank != 0:
        return
    import torch.distributed as dist

    store = me.store
    keys = [f"agree/rank/{r}" for r in range(job.world)]
    deadline = time.monotonic() + WAIT_TIMEOUT.total_seconds()
    while True:
        if check(stats, store, "agree/verdict"):
            raise RoundError("agree/verdict was already published")
        left = deadline - time.monotonic()
        if left <= 0:  # (a zero timeout is no timeout to TCPStore)
            raise RoundError(f"timed out waiting for the {len(keys)} agree/rank/*")
        try:
            wait_within(stats, store, keys, min(timedelta(seconds=left), VERDICT_POLL))
            break
        except dist.DistStoreError:
            stats.ops += 1  # the CANCEL_WAIT that TCPStore sends on a timeout
    answers = wait(stats, store, keys)
    for r, answer in enumerate(answers):
        if answer != OK:
            raise RoundError(f"agree/rank/{r} is not ok")
    if add(stats, store, "agree/verdict-claim", 1) == 1:
        set_(stats, store, "agree/verdict", OK)


def r4_verdict_and_ring_secret(job, me, stats):
    """The end of `agreement::agree` (every rank reads the verdict), then `connect_ring`'s
    `ring_secret` on rank 0 (32 random bytes under `tcp/secret`)."""
    verdict = wait(stats, me.store, ["agree/verdict"])
    if verdict[0] != OK:
        raise RoundError("agree/verdict is not ok")
    if job.ring() and me.rank == 0:
        set_(stats, me.store, "tcp/secret", os.urandom(32))


def r5_ring_nonce_and_addr(job, me, stats):
    """`connect_ring` (`tcp` scope): the others read the secret; every rank publishes its
    nonce (32 bytes) and its listening address."""
    if not job.ring():
        return
    rank = me.rank
    if rank != 0:
        wait(stats, me.store, ["tcp/secret"])
    addr = listen_addr(rank // job.local, 40000 + rank % 20000)
    set_(stats, me.store, f"tcp/peer/{rank}", peer(addr))


def r6_ring_next_and_shm_name(job, me, stats):
    """`connect_ring`: the next rank's address and nonce; then `ShmGroup::connect` ->
    `segment::share` -> `exchange` publishes this rank's segment name (`shm/name/<r>`)."""
    rank = me.rank
    if job.ring():
        nxt = (rank + 1) % job.world
        got = wait(stats, me.store, [f"tcp/peer/{nxt}"])
        check_peer(got[0], f"tcp/peer/{nxt}")
    if job.shm_group(rank) is not None:
        set_(stats, me.store, f"shm/name/{rank}", shm_name().encode())


def r7_shm_names(job, me, stats):
    """`segment::share`: `exchange` waits for every member's name (the segments are mapped),
    then `settle` publishes `shm/mapped/<r>`."""
    group = job.shm_group(me.rank)
    if group is None:
        return
    wait(stats, me.store, [f"shm/name/{r}" for r in group])
    set_(stats, me.store, f"shm/mapped/{me.rank}", OK)


def r8_shm_mapped(job, me, stats):
    """`segment::settle`: waits for every member's `shm/mapped/*`; then `connect_hosts`: each
    host's leader reports (`publish_host_verdict`: counted, the last one writes the verdict)."""
    rank = me.rank
    group = job.shm_group(rank)
    if group is None:
        return
    keys = [f"shm/mapped/{r}" for r in group]
    mapped = wait(stats, me.store, keys)
    for key, value in zip(keys, mapped):
        if value != OK:
            raise RoundError(f"{key} is not ok")
    if job.hierarchical() and rank % job.local == 0:
        # `publish_host_verdict`: every host has shared memory here, so no `without` count;
        # the last leader to report publishes the verdict (how many hosts lack it).
        if add(stats, me.store, "tcp/hosts/shm/reported", 1) == job.hosts():
            without = get_(stats, me.store, "tcp/hosts/shm/without")
            set_(stats, me.store, "tcp/hosts/shm/verdict", without if without is not None else b"0")


def r9_host_verdicts(job, me, stats):
    """`connect_hosts`: every rank waits for the hosts' verdict (one key); each leader opens a
    second connection for the leaders' ring, and the leader of host 0 (ring position 0) draws
    that ring's secret (`ring_secret`, scope `tcp/leaders`)."""
    if not job.hierarchical():
        return
    rank, g = me.rank, me.rank // job.local
    verdict = wait(stats, me.store, ["tcp/hosts/shm/verdict"])
    if verdict[0] != b"0":
        raise RoundError("tcp/hosts/shm/verdict is not 0")
    if rank % job.local == 0:
        leader = connect(job, stats)
        if g == 0:
            set_(stats, leader, "tcp/leaders/secret", os.urandom(32))
        me.leader_store = leader


def r10_leaders_nonce_and_addr(job, me, stats):
    """`connect_ring` of the leaders (scope `tcp/leaders`, position g): the others read the
    secret; every leader publishes its nonce and address."""
    g = me.rank // job.local
    store = me.leader_store
    if store is None:
        return
    if g != 0:
        wait(stats, store, ["tcp/leaders/secret"])
    addr = listen_addr(g, 20000 + g % 20000)
    set_(stats, store, f"tcp/leaders/peer/{g}", peer(addr))


def r11_leaders_next(job, me, stats):
    """`connect_ring` of the leaders: the next leader's address and nonce."""
    g = me.rank // job.local
    store = me.leader_store
    if store is None:
        return
    nxt = (g + 1) % job.hosts()
    got = wait(stats, store, [f"tcp/leaders/peer/{nxt}"])
    check_peer(got[0], f"tcp/leaders/peer/{nxt}")


ROUNDS = [
    ("R1 (rendezvous, agree: claim)", r1_connect_and_claim),
    ("R2 (agree: compare with rank 0)", r2_compare_terms),
    ("R3 (agreement::decide)", r3_decide),
    ("R4 (agree: verdict; tcp ring secret)", r4_verdict_and_ring_secret),
    ("R5 (connect_ring: nonce, address)", r5_ring_nonce_and_addr),
    ("R6 (connect_ring: next rank; shm name)", r6_ring_next_and_shm_name),
    ("R7 (shm: names; mapped)", r7_shm_names),
    ("R8 (shm: mapped; host verdict)", r8_shm_mapped),
    ("R9 (connect_hosts: host verdicts)", r9_host_verdicts),
    ("R10 (leaders' connect_ring: nonce, address)", r10_leaders_nonce_and_addr),
    ("R11 (leaders' connect_ring: next leader)", r11_leaders_next),
]


# ---------------------------------------------------------------------------------------------
# Values

def terms():
    """Rank 0's terms as `agree` publishes them: a JSON object of about 2 KB (40 entries)."""
    entries = [f'"term.{i:02}":"{"0123456789" * 4}"' for i in range(40)]
    return ("{" + ",".join(entries) + "}").encode()


def host_ip(g):
    return f"127.1.{(g >> 8) & 255}.{g & 255}"


def listen_addr(g, port):
    return f"{host_ip(g)}:{port}"


def shm_name():
    return f"/gptrec-{os.getpid()}-{os.urandom(16).hex()}"


def peer(addr):
    """What `connect_ring` publishes for a ring position: its nonce (32 bytes), its address."""
    return os.urandom(32) + addr.encode()


def check_peer(value, key):
    host, _, port = value[32:].decode(errors="replace").rpartition(":")
    if not host or not port.isdigit():
        raise RoundError(f"{key} is not a nonce and an address")


# ---------------------------------------------------------------------------------------------
# Requests, counted and timed

def connect(job, stats):
    import torch.distributed as dist

    started = time.perf_counter()
    try:
        store = dist.TCPStore(job.host, job.port, is_master=False, use_libuv=True,
                              wait_for_workers=False, timeout=WAIT_TIMEOUT)
    except Exception as e:
        raise RoundError(f"connect: {e}") from e
    stats.connects += 1
    stats.max_connect = max(stats.max_connect, time.perf_counter() - started)
    return store


def timed(stats, waits, requests, what, call):
    started = time.perf_counter()
    try:
        return call()
    except Exception as e:
        if isinstance(e, RoundError):
            raise
        raise RoundError(f"{what}: {e}") from e
    finally:
        took = time.perf_counter() - started
        stats.ops += requests
        if waits:
            stats.max_wait = max(stats.max_wait, took)
        else:
            stats.max_op = max(stats.max_op, took)


def set_(stats, store, key, value):
    timed(stats, False, 1, f"set {key!r}", lambda: store.set(key, value))


def check(stats, store, key):
    return timed(stats, False, 1, f"check {key!r}", lambda: store.check([key]))


def get_(stats, store, key):
    """Our `get` (None for a missing key): TCPStore's `get` would wait for it, so `check` first."""
    if not check(stats, store, key):
        return None
    return timed(stats, False, 1, f"get {key!r}", lambda: store.get(key))


def add(stats, store, key, delta):
    return timed(stats, False, 1, f"add {key!r}", lambda: store.add(key, delta))


def shown(keys):
    if len(keys) <= 4:
        return repr(keys)
    return f"{keys[:4]!r} and {len(keys) - 4} more"


def wait(stats, store, keys):
    """Our `wait`, which returns the values: TCPStore's `multi_get` (WAIT, then MULTI_GET)."""
    return timed(stats, True, 2, f"wait for {shown(keys)}", lambda: store.multi_get(keys))


def wait_within(stats, store, keys, timeout):
    """A wait that returns nothing, within `timeout`; TCPStore's error passes through."""
    started = time.perf_counter()
    try:
        store.wait(keys, timeout)
    finally:
        stats.ops += 1
        stats.max_wait = max(stats.max_wait, time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# ranks

def ranks(opts):
    import torch.distributed  # noqa: F401  (imported before the clock starts)

    host, _, port = opts["addr"].rpartition(":")
    world, local = int(opts["world"]), int(opts["local"])
    first, count, threads = int(opts["first"]), int(opts["count"]), int(opts["threads"])
    if world <= 0 or local <= 0 or world % local:
        sys.exit(f"--world {world} must be a positive multiple of --local {local}")
    if count <= 0 or first + count > world:
        sys.exit(f"ranks {first}..{first + count} are not within the {world} ranks")
    job = Job(host, int(port), world, local)
    threads = max(1, min(threads, count))
    results = [None] * threads

    def drive(t, lo, hi):
        stats = Stats()
        sims = [Rank(r) for r in range(lo, hi)]
        for name, round_ in ROUNDS:
            for sim in sims:
                try:
                    round_(job, sim, stats)
                except Exception as e:
                    line = f"control_plane_tcpstore: rank {sim.rank}, round {name}: {e}"
                    print(line[:1000], file=sys.stderr, flush=True)
                    os._exit(1)
        del sims  # teardown: every connection closed
        results[t] = stats

    # The start line (as control-plane-bench): every process ready before any begins.
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    workers = []
    for t in range(threads):
        lo = first + count * t // threads
        hi = first + count * (t + 1) // threads
        worker = threading.Thread(target=drive, args=(t, lo, hi))
        worker.start()
        workers.append(worker)
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    total = Stats()
    for stats in results:
        total.ops += stats.ops
        total.connects += stats.connects
        total.max_op = max(total.max_op, stats.max_op)
        total.max_wait = max(total.max_wait, stats.max_wait)
        total.max_connect = max(total.max_connect, stats.max_connect)
    print(json.dumps({
        "ranks": count, "ops": total.ops, "connects": total.connects,
        "elapsed_s": round(elapsed, 4), "end_unix": time.time(), "max_op_ms": round(total.max_op * 1e3, 3),
        "max_wait_ms": round(total.max_wait * 1e3, 3),
        "max_connect_ms": round(total.max_connect * 1e3, 3),
    }, separators=(",", ":")), flush=True)
    os._exit(0)


def main(argv):
    if not argv or argv[0] not in ("serve", "ranks"):
        sys.exit(__doc__)
    opts = {}
    rest = argv[1:]
    if len(rest) % 2 or not all(a.startswith("--") for a in rest[::2]):
        sys.exit(__doc__)
    for name, value in zip(rest[::2], rest[1::2]):
        opts[name[2:]] = value
    if argv[0] == "serve":
        serve()
    else:
        ranks(opts)


if __name__ == "__main__":
    main(sys.argv[1:])
