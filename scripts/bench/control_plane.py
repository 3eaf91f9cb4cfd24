"""The orchestrator of scripts/bench/control_plane.sh (see its header): for each size, ours then
PyTorch's TCPStore, each a server and PROCS rank processes started at once; the wall time from
their start to the last one's exit, and what the processes printed; then the table.

Usage: control_plane.py BIN TCPSTORE_SCRIPT   (settings from the environment: SIZES, PROCS,
THREADS, LOCAL, LIMIT_S)
"""

import json
import os
import queue
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

BIN, TCPSTORE = sys.argv[1], sys.argv[2]
SIZES = [int(n) for n in os.environ.get("SIZES", "64 512 2048 8192").split()]
PROCS = int(os.environ.get("PROCS", "4"))
THREADS = int(os.environ.get("THREADS", "16"))
LOCAL = int(os.environ.get("LOCAL", "8"))
LIMIT_S = float(os.environ.get("LIMIT_S", "120"))
PYTHON = sys.executable
# How long a server may take to print its port (the TCPStore side imports torch first).
SERVER_START_S = 60
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
            cmd = [BIN] + args + ["--run-id", run_id]
        else:
            cmd = [PYTHON, TCPSTORE] + args
        outs.append(os.path.join(TMP, f"{tag}-{p}.out"))
        errs.append(os.path.join(TMP, f"{tag}-{p}.err"))
        clients.append(cmd)

    # Every client starts, reads its arguments (Python imports torch) and says "ready"; then all
    # are given the start line at once. The clock: from that line to the last client's end
    # (each reports its wall-clock end after its connections are closed).
    ended = [None] * PROCS
    changed = threading.Event()
    procs, client_lines = [], []

    def reap(i, proc):
        proc.wait()
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
    limit_at = started + LIMIT_S
    while True:
        changed.clear()
        done = [e is not None for e in ended]
        failed = [i for i, proc in enumerate(procs) if done[i] and proc.returncode != 0]
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
                reports.append(json.loads(next_line(lines_i, 5) or ""))
            except ValueError:
                result = {"status": "failed", "why": f"process {i} printed no figures"}
                break
        if result["status"] == "ok":
            result["rounds_s"] = max(r["end_unix"] for r in reports) - go_unix
            for key in ("ops", "connects"):
                result[key] = sum(r[key] for r in reports)
            for key in ("max_op_ms", "max_wait_ms", "max_connect_ms"):
                result[key] = max(r[key] for r in reports)

    # Stop the server: EOF on its stdin; it prints its memory and threads.
    try:
        server.stdin.close()
    except OSError:
        pass
    figures = None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        line = next_line(lines, deadline - time.monotonic())
        if line is None:
            break
        if line.startswith("peak_rss_kib"):
            words = line.split()
            figures = dict(zip(words[::2], (int(w) for w in words[1::2])))
            break
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
          f"(connections closed); server memory = peak RSS (TCPStore's includes the Python "
          f"interpreter and torch it runs in: see 'before the store' below)")
    print()
    print("| N | ours s | tcpstore s | ratio | ours round trips per rank | tcpstore requests "
          "per rank | ours server peak MiB | ours server threads | tcpstore server peak MiB | "
          "tcpstore threads |")
    print("|---|---|---|---|---|---|---|---|---|---|")
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
              f"| {cell(theirs, 'peak_mib', '{:.1f}')} | {cell(theirs, 'threads', '{}')} |")
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
    print()
    print("Details (connections opened; the longest set/get/add, wait, connect; server memory "
          "before the store started; the server's warnings):")
    for (n, side), r in results.items():
        if r["status"] == "ok":
            detail = (f"processes started to exited {r['wall_s']:.2f} s; "
                      f"{r['connects']} connections, {r['ops']} requests, longest request "
                      f"{r['max_op_ms']:.1f} ms, wait {r['max_wait_ms']:.1f} ms, connect "
                      f"{r['max_connect_ms']:.1f} ms")
        else:
            detail = f"{r['status']}: {r['why']}"
        if "start_mib" in r:
            detail += f"; server {r['start_mib']:.1f} MiB before the store"
        warnings = r.get("server_warnings") or []
        if warnings:
            detail += f"; {len(warnings)} server log lines, first: {warnings[0][:200]}"
        print(f"  N={n} {side}: {detail}")
    slowest = max((r.get("max_connect_ms", 0) for (_, side), r in results.items()
                   if side == "tcpstore"), default=0)
    if slowest > 4000:
        print(f"note: {DNS_NOTE.format(f'a TCPStore connection took {slowest / 1e3:.1f} s, likely a DNS look-up timing out')}")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
