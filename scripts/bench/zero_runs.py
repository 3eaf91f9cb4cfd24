"""The runs of lib.sh's zero_grid, read back for the ZeRO benchmarks' tables (zero.sh, zero3.sh)."""
import json
import os


def runs(out, stages, transports=("ring", "shm"), worlds=(2, 4)):
    """Yields (transport, world, zero, memory.json, its estimate's terms in MiB by name, the
    summary record, the last test record) of each run, in the grid's order."""
    for transport in transports:
        for world in worlds:
            for zero in stages:
                run = os.path.join(out, "%s-w%d-z%d" % (transport, world, zero))
                mem = json.load(open(os.path.join(run, "memory.json")))
                terms = {t["name"]: t["mib"] for t in mem["estimate"]["terms"]}
                recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
                summary = [r for r in recs if r["kind"] == "summary"][-1]
                test = [r for r in recs if r.get("split") == "test"][-1]
                yield transport, world, zero, mem, terms, summary, test
