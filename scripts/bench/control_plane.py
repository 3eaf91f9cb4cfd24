"""The orchestrator of scripts/bench/control_plane.sh (see its header): for each size, ours then
PyTorch's TCPStore, each a server and PROCS rank processes started at once; the wall time from
their start to the last one's exit (ours: to their set-up figures, then the detection phase,
watch_phase), and what the processes printed; then the table. Then the
elastic rows (ELASTIC, see elastic_side): a real host `launch` and M simulated launchers.

Usage: control_plane.py BIN TCPSTORE_SCRIPT [LAUNCH]   (settings from the environment: SIZES,
PROCS, THREADS, LOCAL, LIMIT_S, ELASTIC, ELASTIC_THREADS; LAUNCH is needed for ELASTIC)
"""

import json
import os
import queue
import secrets
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN, TCPSTORE = sys.argv[1], sys.argv[2]
LAUNCH = sys.argv[3] if len(sys.argv) > 3 else None
SIZES = [int(n) for n in os.environ.get("SIZES", "64 512 2048 8192").split()]
ELASTIC = [int(m) for m in os.environ.get("ELASTIC", "16 128 1024").split()]
ELASTIC_THREADS = int(os.environ.get("ELASTIC_THREADS", "8"))
PROCS = int(os.environ.get("PROCS", "4"))
THREADS = int(os.environ.get("THREADS", "16"))
LOCAL = int(os.environ.get("LOCAL", "8"))
LIMIT_S = float(os.environ.get("LIMIT_S", "120"))
PYTHON = sys.executable
# How long a server may take to print its port (the TCPStore side imports torch first).
SERVER_START_S = 60
# The detection phase (ours): how long the rank processes may take to open their watches, how
# long the waits get to reach the server before the kill, how long the answers may take.
WATCH_START_S = 60
WATCH_SETTLE_S = 0.5
WATCH_ANSWER_S = 20
TMP = tempfile.mkdtemp(prefix="control-plane-")


def lines_of(stream):
    """The lines of `stream`, as they come, on a queue (None at EOF)."""
    out = queue.Queue()

    def pump():
        for line in stream:
            out.put(line.rstrip("\n"))
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def next_line(lines, timeout):
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return None


def first_lines(path, count=3):
    """The first lines of a log that are not PyTorch's start-up noise."""
    noise = ("numpy", "_conversion_method_template", "waitForInput")
    with open(path, errors="replace") as f:
        kept = [line.rstrip() for line in f if line.strip()
                and not any(n in line for n in noise)]
    return kept[:count]


def run_side(side, n):
    """One size on one side: its figures, or its status and why."""
    tag = f"{side}-{n}"
    result = {"status": "ok", "why": ""}
    run_id = secrets.token_hex(16)
    if side == "ours":
        server_cmd = [BIN, "serve", "--run-id", run_id]
    else:
        server_cmd = [PYTHON, TCPSTORE, "serve"]
    server_err = os.path.join(TMP, f"{tag}-server.err")
    with open(server_err, "w") as err:
        server = subprocess.Popen(server_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=err, text=True, close_fds=True)
    lines = lines_of(server.stdout)
    port = None
    deadline = time.monotonic() + SERVER_START_S
    while port is None and time.monotonic() < deadline:
        line = next_line(lines, deadline - time.monotonic())
        if line is None:
            break
        if line.startswith("port "):
            port = int(line.split()[1])
    if port is None:
        server.kill()
        server.wait()
        return {"status": "failed", "why": f"the server gave no port: {first_lines(server_err)}"}

    per = n // PROCS
    clients, outs, errs = [], [], []
    for p in range(PROCS):
        first = p * per
        count = per if p < PROCS - 1 else n - first
        args = ["ranks", "--addr", f"127.0.0.1:{port}", "--world", str(n), "--local",
                str(LOCAL), "--first", str(first), "--count", str(count), "--threads",
                str(THREADS)]
        if side == "ours":
            cmd = [BIN] + args + ["--run-id", run_id, "--watch"]
        else:
            cmd = [PYTHON, TCPSTORE] + args
        outs.append(os.path.join(TMP, f"{tag}-{p}.out"))
        errs.append(os.path.join(TMP, f"{tag}-{p}.err"))
        clients.append(cmd)

    # Every client starts, reads its arguments (Python imports torch) and says "ready"; then all
    # are given the start line at once. The clock: from that line to the last client's end
    # (each reports its wall-clock end after its connections are closed; ours, which go on to
    # the detection phase, keep them open and report the end of their set-up rounds).
    watch = side == "ours"
    ended = [None] * PROCS
    exited = [False] * PROCS
    setup_lines = [None] * PROCS
    changed = threading.Event()
    procs, client_lines = [], []

    def reap(i, proc):
        proc.wait()
        exited[i] = True
        if not watch:
            ended[i] = time.perf_counter()
        changed.set()

    def setup_figures(i):
        """With the detection phase, a client's set-up ends at its figures line."""
        setup_lines[i] = client_lines[i].get()
        ended[i] = time.perf_counter()
        changed.set()

    for i, cmd in enumerate(clients):
        with open(errs[i], "w") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, text=True, close_fds=True)
        procs.append(proc)
        client_lines.append(lines_of(proc.stdout))
    ready_by = time.monotonic() + SERVER_START_S
    for i, lines_i in enumerate(client_lines):
        line = next_line(lines_i, max(0.0, ready_by - time.monotonic()))
        if line != "ready":
            for proc in procs:
                proc.kill()
            server.kill()
            return {"status": "failed",
                    "why": f"process {i} did not get ready: {first_lines(errs[i], 2)}"}
    started = time.perf_counter()
    go_unix = time.time()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for i, proc in enumerate(procs):
        threading.Thread(target=reap, args=(i, proc), daemon=True).start()
        if watch:
            threading.Thread(target=setup_figures, args=(i,), daemon=True).start()
    limit_at = started + LIMIT_S
    while True:
        changed.clear()
        done = [e is not None for e in ended]
        failed = [i for i, proc in enumerate(procs) if exited[i] and proc.returncode != 0]
        if failed or all(done):
            break
        left = limit_at - time.perf_counter()
        if left <= 0:
            result = {"status": "timeout", "why": f"still running after {LIMIT_S:.0f} s"}
            break
        changed.wait(min(left, 1.0))
    if failed:
        i = failed[0]
        why = first_lines(errs[i], 2) or [f"exit status {procs[i].returncode}"]
        result = {"status": "failed", "why": f"process {i}: " + " | ".join(why)}
    if result["status"] != "ok" or not watch:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
    if result["status"] == "ok":
        result["wall_s"] = max(ended) - started
        reports = []
        for i, lines_i in enumerate(client_lines):
            try:
                line = setup_lines[i] if watch else next_line(lines_i, 5)
                reports.append(json.loads(line or ""))
            except ValueError:
                result = {"status": "failed", "why": f"process {i} printed no figures"}
                break
        if result["status"] == "ok":
            result["rounds_s"] = max(r["end_unix"] for r in reports) - go_unix
            for key in ("ops", "connects"):
                result[key] = sum(r[key] for r in reports)
            for key in ("max_op_ms", "max_wait_ms", "max_connect_ms"):
                result[key] = max(r[key] for r in reports)

    def server_figures(timeout=15):
        """The server's memory and threads so far (it prints them for `figures`, or at EOF)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = next_line(lines, deadline - time.monotonic())
            if line is None:
                return None
            if line.startswith("peak_rss_kib"):
                words = line.split()
                return dict(zip(words[::2], (int(w) for w in words[1::2])))
        return None

    figures = None
    if watch:
        # The set-up's figures (comparable with TCPStore's), then the detection phase.
        if result["status"] == "ok":
            try:
                server.stdin.write("figures\n")
                server.stdin.flush()
                figures = server_figures()
            except OSError:
                pass
            result["watch"] = watch_phase(n, procs, client_lines, errs, server.pid)
        for proc in procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # Stop the server: EOF on its stdin; it prints its memory and threads.
    try:
        server.stdin.close()
    except OSError:
        pass
    final = server_figures()
    if final and watch and figures:
        result["watch_peak_mib"] = final["peak_rss_kib"] / 1024
    figures = figures or final
    if server.poll() is None:
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if figures:
        result["peak_mib"] = figures["peak_rss_kib"] / 1024
        result["threads"] = figures["threads_max"]
        result["start_mib"] = figures.get("rss_start_kib", 0) / 1024
    warnings = first_lines(server_err, 100)
    result["server_warnings"] = warnings
    return result


def watch_phase(n, procs, client_lines, errs, server_pid):
    """The detection phase (ours; `watch.rs`): every process has every rank's will left and
    its watch parked; rank N/2 dies (its watching connection closed); when every other rank
    was told, and that its line names N/2."""
    killed = n // 2
    deadline = time.monotonic() + WATCH_START_S
    for i, lines_i in enumerate(client_lines):
        line = next_line(lines_i, max(0.0, deadline - time.monotonic()))
        if line != "watching":
            why = first_lines(errs[i], 2) or [repr(line)]
            return {"status": "failed", "why": f"process {i} is not watching: {why}"}
    time.sleep(WATCH_SETTLE_S)
    server_ticks = cpu_ticks(server_pid)
    for proc in procs:
        proc.stdin.write(f"kill {killed}\n")
        proc.stdin.flush()
    reports = []
    deadline = time.monotonic() + WATCH_ANSWER_S
    for i, lines_i in enumerate(client_lines):
        line = next_line(lines_i, max(0.0, deadline - time.monotonic()))
        try:
            reports.append(json.loads(line or ""))
        except ValueError:
            why = first_lines(errs[i], 2) or [repr(line)]
            return {"status": "failed", "why": f"process {i} gave no detection figures: {why}"}
    # The server's CPU over the phase (its share of the fan-out; 1 / CLK_TCK s resolution).
    server_cpu_ms = (cpu_ticks(server_pid) - server_ticks) * 1e3 / CLK_TCK
    owners = [r for r in reports if "kill_unix" in r]
    if len(owners) != 1:
        return {"status": "failed", "why": f"{len(owners)} processes killed rank {killed}"}
    kill_unix = owners[0]["kill_unix"]
    watchers = sum(r["watchers"] for r in reports)
    told = sum(r["answered"] for r in reports)
    firsts = [r["watch_first_unix"] for r in reports if r.get("watch_first_unix") is not None]
    lasts = [r["watch_last_unix"] for r in reports if r.get("watch_last_unix") is not None]
    wrong = [r["line"] for r in reports if not r["line"].startswith(f"rank {killed} (")]
    result = {"status": "ok", "why": "", "killed": killed, "watchers": watchers, "told": told,
              "line": owners[0]["line"], "server_cpu_ms": server_cpu_ms}
    if firsts:
        result["first_ms"] = (min(firsts) - kill_unix) * 1e3
        result["detect_ms"] = (max(lasts) - kill_unix) * 1e3
    errors = [r["error"] for r in reports if r.get("error")]
    if watchers != n - 1 or told != n - 1 or wrong or errors:
        result["status"] = "failed"
        result["why"] = (f"{told} of {watchers} watchers told rank {killed}'s line (of {n - 1})"
                         + (f"; seen: {wrong[0]!r}" if wrong else "")
                         + (f"; {len(errors)} processes' waits failed: {errors[0][:200]}"
                            if errors else ""))
    return result


def watch_cell(result):
    """The detection column: ours' figure, or why none."""
    w = result.get("watch")
    if result["status"] != "ok" or w is None:
        return "-"
    if w["status"] != "ok" or "detect_ms" not in w:
        return w["status"]
    return f"{w['detect_ms']:.1f}"


def slow_reverse_dns():
    """How long the slowest of 16 concurrent reverse look-ups of ::ffff:127.0.0.1 takes (what
    PyTorch's client does for every connection it opens, to name its peer)."""
    worst = [0.0]

    def look():
        t0 = time.perf_counter()
        try:
            socket.getnameinfo(("::ffff:127.0.0.1", 1), socket.NI_NUMERICSERV)
        except OSError:
            pass
        worst[0] = max(worst[0], time.perf_counter() - t0)

    lookups = [threading.Thread(target=look) for _ in range(16)]
    for t in lookups:
        t.start()
    for t in lookups:
        t.join()
    return worst[0]


DNS_NOTE = ("{}; PyTorch's TCPStore client makes one for every connection it opens (it names "
            "its peer eagerly) and every wait that times out, so its figures include that wait "
            "(LOOPBACK_HOSTS=1 answers it from a private /etc/hosts)")


def cell(result, key, fmt):
    if result["status"] != "ok" and key in ("wall_s", "rounds_s", "ops", "connects"):
        return result["status"]
    value = result.get(key)
    return "-" if value is None else fmt.format(value)


def main():
    if SIZES:
        ranks_rows()
    if ELASTIC:
        if SIZES:
            print()
        elastic_rows()


def ranks_rows():
    dns = slow_reverse_dns()
    if dns > 0.5:
        print(f"note: {DNS_NOTE.format(f'a reverse DNS look-up of ::ffff:127.0.0.1 took {dns:.1f} s here')}",
              flush=True)
    results = {}
    for n in SIZES:
        if n % LOCAL or n % PROCS:
            print(f"N={n}: skipped (not a multiple of LOCAL={LOCAL} and PROCS={PROCS})")
            continue
        for side in ("ours", "tcpstore"):
            t0 = time.perf_counter()
            results[(n, side)] = r = run_side(side, n)
            shown = (f"{r['rounds_s']:.2f} s" if r["status"] == "ok"
                     else f"{r['status']}: {r['why']}")
            print(f"  N={n} {side}: {shown} (harness {time.perf_counter() - t0:.1f} s)",
                  flush=True)

    print()
    print(f"Control plane: N ranks, {LOCAL} per host (each host its own loopback address for "
          f"ours), {PROCS} client processes x {THREADS} threads; time = from the start line "
          f"given to every ready client process to the last simulated rank's end of set-up "
          f"(connections closed; ours keep theirs for the detection phase); server memory = peak RSS (TCPStore's includes the Python "
          f"interpreter and torch it runs in: see 'before the store' below)")
    print()
    print(f"Detection (ours only: TCPStore has no wills): after the set-up, every rank leaves its "
          f"will on one more connection and parks a wait for job/failed there (as "
          f"runtime/src/job_watch.rs); rank N/2's watching connection is closed (its death); "
          f"the time from that to the last of the other N-1 ranks' waits answered with its line "
          f"(clients' wall clocks, one machine)")
    print()
    print("| N | ours s | tcpstore s | ratio | ours requests per rank | tcpstore requests "
          "per rank | ours server peak MiB | ours server threads | tcpstore server peak MiB | "
          "tcpstore threads | ours death to detection (all ranks told) ms | tcpstore death to "
          "detection ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in SIZES:
        if (n, "ours") not in results:
            continue
        ours, theirs = results[(n, "ours")], results[(n, "tcpstore")]
        ok = ours["status"] == "ok" and theirs["status"] == "ok"
        ratio = f"{theirs['rounds_s'] / ours['rounds_s']:.1f}x" if ok else "-"
        per_rank = lambda r: f"{r['ops'] / n:.1f}" if r["status"] == "ok" else r["status"]
        print(f"| {n} | {cell(ours, 'rounds_s', '{:.2f}')} | {cell(theirs, 'rounds_s', '{:.2f}')} "
              f"| {ratio} | {per_rank(ours)} | {per_rank(theirs)} "
              f"| {cell(ours, 'peak_mib', '{:.1f}')} | {cell(ours, 'threads', '{}')} "
              f"| {cell(theirs, 'peak_mib', '{:.1f}')} | {cell(theirs, 'threads', '{}')} "
              f"| {watch_cell(ours)} | n/a |")
    print()
    for n in SIZES:
        if (n, "ours") not in results:
            continue
        shown = []
        for side in ("ours", "tcpstore"):
            r = results[(n, side)]
            shown.append(f"{side} {r['rounds_s']:.2f} s" if r["status"] == "ok"
                         else f"{side} {r['status']}")
        print(f"{n} ranks: {shown[0]}, {shown[1]}")
    for n in SIZES:
        if (n, "ours") not in results:
            continue
        shown = watch_cell(results[(n, "ours")])
        unit = " ms" if shown[:1].isdigit() else ""
        print(f"{n} ranks: death to detection (all {n - 1} told) {shown}{unit}")
    print()
    print("Details (connections opened; the longest set/get/add, wait, connect; server memory "
          "before the store started; the server's warnings):")
    for (n, side), r in results.items():
        if r["status"] == "ok":
            ended = "set-up ended" if "watch" in r else "exited"
            detail = (f"processes started to {ended} {r['wall_s']:.2f} s; "
                      f"{r['connects']} connections, {r['ops']} requests, longest request "
                      f"{r['max_op_ms']:.1f} ms, wait {r['max_wait_ms']:.1f} ms, connect "
                      f"{r['max_connect_ms']:.1f} ms")
        else:
            detail = f"{r['status']}: {r['why']}"
        if "start_mib" in r:
            detail += f"; server {r['start_mib']:.1f} MiB before the store"
        w = r.get("watch")
        if w and w["status"] == "ok":
            detail += (f"; detection: rank {w['killed']}'s death, first rank told after "
                       f"{w['first_ms']:.1f} ms, all {w['told']} after {w['detect_ms']:.1f} ms "
                       f"(server CPU meanwhile {w['server_cpu_ms']:.0f} ms), "
                       f"line {w['line']!r}")
        elif w:
            detail += f"; detection {w['status']}: {w['why']}"
        if "watch_peak_mib" in r:
            detail += (f"; server peak {r['watch_peak_mib']:.1f} MiB with the watches "
                       f"(2N + N/L connections)")
        warnings = r.get("server_warnings") or []
        if warnings:
            detail += f"; {len(warnings)} server log lines, first: {warnings[0][:200]}"
        print(f"  N={n} {side}: {detail}")
    slowest = max((r.get("max_connect_ms", 0) for (_, side), r in results.items()
                   if side == "tcpstore"), default=0)
    if slowest > 4000:
        print(f"note: {DNS_NOTE.format(f'a TCPStore connection took {slowest / 1e3:.1f} s, likely a DNS look-up timing out')}")


# ---------------------------------------------------------------------------------------------
# The elastic rows: a real host `launch` (its rendezvous store and coordinator) and M simulated
# launchers (`control-plane-bench launchers`, store/src/bin/control_plane_bench/elastic.rs).

# The host: `--nnodes M:M+1` with a last call longer than any run, so the first round closes
# when it is full (all M + 1 joined: coordinator.rs `form`, `full`), and after one death the M
# left re-form as soon as every live node joined the next round (`all_in`), M being the minimum;
# restarts to spare. Its worker only sleeps (a plain command: a regroup stops it at once).
HOST_ARGS = ["--nproc-per-node", "1", "--rdzv-conf", "last_call_timeout=3600",
             "--max-restarts", "10", "--grace-period", "2", "--", "sleep", "3600"]
# How long the first round runs before one launcher is killed, and how long the next round runs
# before the idle figures are taken over IDLE_S.
RUN_BEFORE_KILL_S = 2.0
SETTLE_S = 0.5
SETTLE_MAX_S = 10.0
# The simulator is settled when none of its actions ran later than this in the last SETTLE_S.
SETTLED_LATE_MS = 50.0
IDLE_S = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_ticks(pid):
    """utime + stime of process `pid` (every thread of it), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def thread_ticks(pid):
    """utime + stime of each thread of `pid`, summed by thread name."""
    by_name = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        by_name[name] = by_name.get(name, 0) + int(fields[11]) + int(fields[12])
    return by_name


def status_field(pid, name):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def descendants(pid):
    """Every process below `pid` (its workers, its watchdog), deepest last."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                kids = []
            found.extend(kids)
            todo.extend(kids)
    return found


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_host(host):
    """SIGTERM to the host's process group (launch forwards it to its workers), then SIGKILL
    to it and to whatever it left (workers, watchdog) after 15 s."""
    below = descendants(host.pid)
    if host.poll() is None:
        try:
            os.killpg(host.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            host.wait(15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(host.pid, signal.SIGKILL)
            except OSError:
                pass
            host.wait()
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in below):
        time.sleep(0.05)


def elastic_side(m):
    """The elastic rows' figures for M simulated launchers, or status and why."""
    tag = f"elastic-{m}"
    run_id = secrets.token_hex(16)
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SLURM_") or k.startswith("PET_") or k == "LAUNCH_RUN_ID")}
    host_log = os.path.join(TMP, f"{tag}-host.log")
    sim_err = os.path.join(TMP, f"{tag}-sim.err")
    host_cmd = [LAUNCH, "--nnodes", f"{m}:{m + 1}", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", run_id] + HOST_ARGS
    with open(host_log, "w") as log:
        host = subprocess.Popen(host_cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, close_fds=True,
                                start_new_session=True)
    sim_cmd = [BIN, "launchers", "--addr", f"127.0.0.1:{port}", "--run-id", run_id,
               "--count", str(m), "--threads", str(ELASTIC_THREADS)]
    with open(sim_err, "w") as err:
        sim = subprocess.Popen(sim_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=err, text=True, close_fds=True)
    lines = lines_of(sim.stdout)
    result = {"status": "ok", "why": ""}

    def say(line):
        sim.stdin.write(line + "\n")
        sim.stdin.flush()

    def expect(prefix, timeout):
        """The words of the simulator's next line that starts with `prefix` (others are kept
        in `seen`)."""
        deadline = time.monotonic() + timeout
        while True:
            line = next_line(lines, max(0.0, deadline - time.monotonic()))
            if line is None:
                why = "ended" if sim.poll() is not None else f"nothing within {timeout:.0f} s"
                raise RuntimeError(f"waiting for {prefix!r}: the simulator {why}: "
                                   f"{first_lines(sim_err, 2)} host: {first_lines(host_log, 100)[-2:]}")
            if line.startswith(prefix):
                return line.split()
            seen.append(line)

    seen = []

    def joined_at(k):
        """When every live simulated launcher had written its join entry of round k."""
        for line in seen:
            if line.startswith(f"joined {k} "):
                return float(line.split()[3])
        return float("nan")

    try:
        expect("ready", SERVER_START_S)
        say("go")
        started = float(expect("started", 5)[1])
        words = expect("round 0 members", LIMIT_S)
        if int(words[3]) != m + 1:
            raise RuntimeError(f"round 0 formed with {words[3]} nodes, not {m + 1}")
        result["form_s"] = float(words[4]) - started
        result["joined0_s"] = joined_at(0) - started
        time.sleep(RUN_BEFORE_KILL_S)
        say("kill")
        killed = float(expect("killed", 5)[2])
        result["detect_s"] = float(expect("round 0 failed", LIMIT_S)[3]) - killed
        words = expect("round 1 members", LIMIT_S)
        if int(words[3]) != m:
            raise RuntimeError(f"round 1 formed with {words[3]} nodes, not {m}")
        result["next_s"] = float(words[4]) - killed
        result["joined1_s"] = joined_at(1) - killed
        # Idle means settled: the simulator keeps its cadence again (right after a re-form, its
        # threads open a thousand monitor connections and heartbeats run late meanwhile).
        settle_by = time.monotonic() + SETTLE_MAX_S
        while True:
            time.sleep(SETTLE_S)
            say("stats")
            before = expect("stats", 5)
            if float(before[2]) < SETTLED_LATE_MS or time.monotonic() > settle_by:
                break
        threads0 = thread_ticks(host.pid)
        host0, sim0, t0 = cpu_ticks(host.pid), cpu_ticks(sim.pid), time.monotonic()
        time.sleep(IDLE_S)
        say("stats")
        after = expect("stats", 5)
        host1, sim1, t1 = cpu_ticks(host.pid), cpu_ticks(sim.pid), time.monotonic()
        threads1 = thread_ticks(host.pid)
        core = lambda ticks: 100.0 * ticks / CLK_TCK / (t1 - t0)
        result["host_cpu"] = core(host1 - host0)
        busy = sorted(((core(t - threads0.get(name, 0)), name) for name, t in threads1.items()),
                      reverse=True)
        result["host_threads_cpu"] = ", ".join(f"{name} {pct:.1f} %" for pct, name in busy[:3]
                                               if pct > 0) or "none measurable"
        result["sim_cpu"] = core(sim1 - sim0)
        result["host_rss_mib"] = status_field(host.pid, "VmRSS") / 1024
        result["host_threads"] = status_field(host.pid, "Threads")
        result["sim_rps"] = (int(after[1]) - int(before[1])) / (float(after[3]) - float(before[3]))
        result["sim_late_ms"] = float(after[2])
    except (RuntimeError, ValueError, IndexError, OSError) as e:
        result = {"status": "failed", "why": str(e)}
    # Stop: the simulated launchers first (EOF: they close their connections and exit), then
    # the host and its workers.
    try:
        sim.stdin.close()
    except OSError:
        pass
    try:
        sim.wait(30)
    except subprocess.TimeoutExpired:
        sim.kill()
        sim.wait()
    for line in iter(lambda: next_line(lines, 1), None):
        if line.startswith("{"):
            try:
                report = json.loads(line)
                if report.get("errors") and result["status"] == "ok":
                    result["sim_errors"] = report["errors"]
            except ValueError:
                pass
    stop_host(host)
    if result["status"] == "ok":
        errors = first_lines(sim_err, 3)
        if errors:
            result["sim_stderr"] = errors
    return result


def elastic_rows():
    if not LAUNCH:
        print("elastic rows: skipped (no launch binary given)")
        return
    results = {}
    for m in ELASTIC:
        t0 = time.perf_counter()
        results[m] = r = elastic_side(m)
        shown = (f"form {r['form_s']:.2f} s, death to next round {r['next_s']:.2f} s"
                 if r["status"] == "ok" else f"{r['status']}: {r['why']}")
        print(f"  M={m} elastic: {shown} (harness {time.perf_counter() - t0:.1f} s)", flush=True)
    print()
    print(f"Elastic rendezvous: a real host `launch --nnodes M:M+1` (its store and coordinator; "
          f"its worker sleeps) and M simulated launchers (one process, {ELASTIC_THREADS} threads "
          f"and one monitor thread per member, each launcher from its own loopback address) at "
          f"the real cadence (heartbeat 500 ms, join polls 100 ms, monitors parked in 5 s waits "
          f"for the round's end). form = from the simulated launchers' start to round "
          f"0's members (M + 1 nodes) published; detection = from one simulated launcher's death "
          f"(its connections closed at once) to round 0's `failed`; next round = from that death "
          f"to round 1's members (M nodes); host CPU (% of one core, every thread of the host "
          f"`launch`, not its worker) and RSS while round 1 runs, over {IDLE_S:.0f} s")
    print()
    print("| launchers | form s | death to detection s | death to next round s | "
          "host CPU idle % | host RSS MiB |")
    print("|---|---|---|---|---|---|")
    for m, r in results.items():
        if r["status"] != "ok":
            print(f"| {m} | {r['status']} | - | - | - | - |")
            continue
        print(f"| {m} | {r['form_s']:.2f} | {r['detect_s']:.2f} | {r['next_s']:.2f} "
              f"| {r['host_cpu']:.1f} | {r['host_rss_mib']:.1f} |")
    print()
    for m, r in results.items():
        if r["status"] == "ok":
            print(f"{m} launchers: form {r['form_s']:.2f} s, death to next round "
                  f"{r['next_s']:.2f} s")
        else:
            print(f"{m} launchers: {r['status']}")
    print()
    print("Details (when the last simulated launcher had joined round 0, from their start, and "
          "round 1, from the death: the rest is the coordinator's; while round 1 runs: the "
          "simulator's own CPU, its requests per second and how late its latest action ran, the "
          "host's threads):")
    for m, r in results.items():
        if r["status"] == "ok":
            detail = (f"all joined round 0 at {r['joined0_s']:.2f} s, round 1 at "
                      f"{r['joined1_s']:.2f} s; simulator CPU {r['sim_cpu']:.1f} % of one core, "
                      f"{r['sim_rps']:.0f} launcher requests/s, latest action "
                      f"{r['sim_late_ms']:.1f} ms late; host {r['host_threads']} threads, "
                      f"busiest: {r['host_threads_cpu']}")
            if r.get("sim_errors"):
                detail += f"; {r['sim_errors']} simulated launchers' store errors"
            if r.get("sim_stderr"):
                detail += f"; simulator stderr: {r['sim_stderr'][0][:200]}"
        else:
            detail = f"{r['status']}: {r['why']}"
        print(f"  M={m}: {detail}")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
