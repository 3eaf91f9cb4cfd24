"""Plain PyTorch DDP (gloo) training of the same recommenders our worker trains, as the peer in
scripts/bench/vs_pytorch.sh. Started by any torchrun-compatible launcher (ours or torchrun).

Same as ours: the data (ratings.dat of an ML-1M directory, ratings >= 3, each user's distinct
items cut 80/10/10 into train/valid/test), the model (user and item ID embeddings of size 64,
N(0, 0.1) initialised; for `cached` also fixed text features of width 64, the tiny GPT-2's, each
side projected by a Linear to 64 and added; a dot scorer), the loss (BPR with one uniform
negative per positive, not in the user's train items, plus l2 1e-4 x the squared norms of the
batch's embeddings / batch), AdamW (lr 5e-3, weight decay 0), global-norm clipping at 1.0,
DistributedSampler (shuffled per epoch), and micro x grad_accum x world = global with
`no_sync` on the accumulation steps. The text features are random rather than GPT-2's: they are
constants in cached mode, so their values do not change the work.

Prints one line on rank 0: `peer samples/s N` (training samples of all ranks per second of
training steps, evaluation excluded, as our trainer's `samples_per_s`).

On a GPU (`PEER_DEVICE=cuda`) each rank trains on `cuda:LOCAL_RANK` with the nccl backend, as a
plain eager script does: the batch is indexed on the host, negatives drawn in Python, and each
micro batch copied to the device.

Usage: [PEER_DEVICE=cuda] ddp_peer.py DATA_DIR MODEL(bpr|cached) EPOCHS GLOBAL MICRO
"""
import os
import random
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

DIM, TEXT_WIDTH, LR, L2, CLIP, MIN_RATING, SEED = 64, 64, 5e-3, 1e-4, 1.0, 3, 42


def read_train(data_dir):
    """(user, item) training pairs, per-user train item sets, n_users, n_items."""
    per_user = {}
    with open(os.path.join(data_dir, "ratings.dat"), encoding="latin-1") as f:
        for line in f:
            user, movie, rating, _ = line.rstrip("\n").split("::")
            if int(rating) >= MIN_RATING:
                per_user.setdefault(int(user), set()).add(int(movie))
    items = sorted({m for s in per_user.values() for m in s})
    imap = {m: i for i, m in enumerate(items)}
    pairs, owned = [], []
    for d, user in enumerate(sorted(per_user)):
        mine = sorted(imap[m] for m in per_user[user])
        random.Random(SEED * 1_000_003 + user).shuffle(mine)
        k = len(mine) // 10
        train = sorted(mine[: len(mine) - 2 * k])
        owned.append(set(train))
        pairs.extend((d, i) for i in train)
    return torch.tensor(pairs, dtype=torch.long), owned, len(per_user), len(items)


class Recommender(nn.Module):
    def __init__(self, n_users, n_items, cached):
        super().__init__()
        self.user_id = nn.Embedding(n_users, DIM)
        self.item_id = nn.Embedding(n_items, DIM)
        for e in (self.user_id, self.item_id):
            nn.init.normal_(e.weight, 0.0, 0.1)
        self.cached = cached
        if cached:
            self.register_buffer("user_text", torch.randn(n_users, TEXT_WIDTH))
            self.register_buffer("item_text", torch.randn(n_items, TEXT_WIDTH))
            self.user_proj = nn.Linear(TEXT_WIDTH, DIM)
            self.item_proj = nn.Linear(TEXT_WIDTH, DIM)

    def repr(self, side, ids):
        x = getattr(self, f"{side}_id")(ids)
        if not self.cached:
            return x
        text = getattr(self, f"{side}_text").index_select(0, ids)
        return x + getattr(self, f"{side}_proj")(text)

    def forward(self, users, pos, neg):
        u = self.repr("user", users)
        i = self.repr("item", torch.cat([pos, neg]))
        p, n = i.split(len(pos))
        diff = (u * p).sum(-1) - (u * n).sum(-1)
        bpr = -torch.log(1e-10 + torch.sigmoid(diff)).mean()
        reg = (self.user_id(users).square().sum() + self.item_id(pos).square().sum()
               + self.item_id(neg).square().sum()) / len(users)
        return bpr + L2 * reg


def negatives(users, owned, n_items, rng):
    out = []
    for u in users.tolist():
        while True:
            c = rng.randrange(n_items)
            if c not in owned[u]:
                out.append(c)
                break
    return torch.tensor(out, dtype=torch.long)


def main():
    data_dir, kind, epochs, global_batch, micro = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    on_gpu = os.environ.get("PEER_DEVICE", "cpu") == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if global_batch % (micro * world):
        sys.exit(f"global {global_batch} is not divisible by micro {micro} x world {world}")
    accum = global_batch // (micro * world)
    torch.manual_seed(SEED)
    pairs, owned, n_users, n_items = read_train(data_dir)
    model = Recommender(n_users, n_items, kind == "cached").to(device)
    model = DDP(model, device_ids=[device.index] if on_gpu else None)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sampler = DistributedSampler(range(len(pairs)), world, rank, shuffle=True, seed=SEED, drop_last=True)
    rng = random.Random(SEED + rank)
    per_step = micro * accum
    samples, seconds = 0, 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.long)
        steps = len(order) // per_step
        dist.barrier()
        t0 = time.perf_counter()
        for s in range(steps):
            for a in range(accum):
                idx = order[(s * accum + a) * micro:(s * accum + a + 1) * micro]
                users, pos = pairs[idx, 0], pairs[idx, 1]
                neg = negatives(users, owned, n_items, rng).to(device)
                users, pos = users.to(device), pos.to(device)
                if a + 1 < accum:
                    with model.no_sync():
                        (model(users, pos, neg) / accum).backward()
                else:
                    (model(users, pos, neg) / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        seconds += time.perf_counter() - t0
        samples += steps * per_step * world
    if rank == 0:
        print(f"peer samples/s {samples / seconds:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
