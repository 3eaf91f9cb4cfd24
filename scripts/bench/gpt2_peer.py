"""Plain PyTorch + transformers DDP training of our dynamic GPT-2 recommender, as the peer in
scripts/bench/vs_pytorch_gpt2.sh. Started by any torchrun-compatible launcher (ours or torchrun),
on the directory our worker wrote with GPTREC_DUMP_PEER=DIR (worker/src/peer_dump.rs).

Same as ours, from the dump: the initial value of every variable (our names; GPT-2's are
Hugging Face GPT2Model's under `gpt2.`), which of them train, the token tables (texts and token
lengths), the training pairs, the micro and global batch, and the hyper-parameters. The model:
user and item ID embeddings (dense `nn.Embedding`; ours are sparse), transformers' `GPT2Model`
with `attn_implementation="sdpa"` run on the micro batch's user texts and, in one pass, on its
positives' and negatives' item texts, each cut to the longest real text among them; the last
hidden state mean-pooled over real tokens, layer-normalised without affine and divided by
sqrt(width); `nn.Linear` text projections; `id + proj(text)`, a dot scorer; BPR
`-log(1e-10 + sigmoid(pos - neg)).mean()` plus l2 x the squared norms of the batch's ID
embeddings / batch plus text_l2 x those of its text parts / batch. Texts are right-padded and
attention is causal, so real tokens never see padding: no attention mask is passed (ours passes
none either), which lets SDPA run its causal kernels. Dropout as GPT-2's config (on in
training); with our activation checkpointing, transformers' (each block recomputed in backward).
AdamW (betas, eps, weight decay from the dump; `fused=True` on CUDA), global-norm clipping, DDP
with `no_sync` on accumulation steps. Not mirrored, as they change no work: the
learning-rate schedule (constant here) and the negatives' exclusion of the user's own items
(uniform among the warm items here).

A plain eager script's data path: each micro batch is indexed and cut on the host (the table
rows, the longest text from the host's lengths) and copied to the device from pinned memory.

First the parity check: in eval mode (no dropout), on the dumped micro batch, the loss must
equal ours (`loss` in meta.json) within the precision's relative tolerance (PARITY_TOL
overrides), with the variables as dumped and again with the text projections set to the dump's
probe values (they start at zero, which would hide GPT-2 from the loss). Then training: WARMUP
steps, then STEPS timed steps on random batches of the training pairs (samples/s from their wall
time; on CUDA synchronised at the window's ends only), then the per-phase times: on CUDA over
PHASE_STEPS more steps, synchronised at every phase boundary (on the CPU, the timed steps' own).

Prints on rank 0, one figure per line:
  peer parity <precision>: ours L peer L diff D rel R, probe: ours L peer L diff D rel R (tolerance T): ok
  peer samples/s N
  peer samples/s synchronised per phase N   (CUDA only: the phase steps' own rate)
  peer ms/step data D forward F backward B optimizer O (mean over K steps after W warm-up steps)
  peer tokens/sample T, flops/sample F
with the FLOPs per sample (3 texts: user, positive, negative; real tokens only) of
  sum over texts of (6 P_trained + 2 P_frozen) len + (12 L_trained + 4 L_frozen) d len^2,
P: GPT-2's non-embedding parameters in trained / frozen blocks (the final norm with the top),
L: trained / frozen blocks, d: width, len: the text's real tokens (model FLOPs: activation
checkpointing's recomputation is not counted).

Environment: PRECISION f32 | tf32 | bf16 (autocast), default f32; PEER_DEVICE cpu (default,
gloo) | cuda (cuda:LOCAL_RANK, nccl); WARMUP (3), PHASE_STEPS (min(STEPS, 10)), PARITY_TOL.

Usage: [PEER_DEVICE=cuda] [PRECISION=bf16] gpt2_peer.py DUMP_DIR STEPS
"""
import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import GPT2Config, GPT2Model

# Relative tolerance of the parity check per precision (bf16 and TF32 keep 8 and 10 bits of
# mantissa in the products; the two sides round in different places).
TOLERANCE = {"f32": 1e-5, "tf32": 1e-2, "bf16": 2e-2}
# On CUDA, f32 kernels (reductions, SDPA's) differ more than on the CPU.
TOLERANCE_CUDA_F32 = 1e-4


def fail(message):
    print(f"gpt2_peer.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class Recommender(nn.Module):
    """Our recommender in PyTorch: forward gives the loss of one micro batch."""

    def __init__(self, meta):
        super().__init__()
        g, dim = meta["gpt2"], meta["dim"]
        self.user_id = nn.Embedding(meta["n_users"], dim)
        self.item_id = nn.Embedding(meta["n_items"], dim)
        config = GPT2Config(
            vocab_size=g["vocab_size"], n_positions=g["n_positions"], n_embd=g["n_embd"],
            n_layer=g["n_layer"], n_head=g["n_head"], layer_norm_epsilon=g["layer_norm_epsilon"],
            embd_pdrop=g["embd_pdrop"], attn_pdrop=g["attn_pdrop"], resid_pdrop=g["resid_pdrop"],
            activation_function="gelu_new", use_cache=False,
        )
        self.gpt2 = GPT2Model._from_config(config, attn_implementation="sdpa")
        if meta["activation_checkpointing"]:
            # As ours with model.activation_checkpointing: each block recomputed in backward.
            # (transformers 5.24 names it activation_checkpointing_enable, earlier ones
            # gradient_checkpointing_enable.)
            kwargs = {"use_reentrant": False}
            if hasattr(self.gpt2, "activation_checkpointing_enable"):
                self.gpt2.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.gpt2.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.user_text_proj = nn.Linear(g["n_embd"], dim)
        self.item_text_proj = nn.Linear(g["n_embd"], dim)
        self.l2, self.text_l2 = meta["l2"], meta["text_l2"]

    def encode(self, ids, mask):
        """GPT-2 features of texts [b, t] (already cut to their longest): mean over real tokens,
        layer norm without affine, / sqrt(width)."""
        hidden = self.gpt2(input_ids=ids, use_cache=False).last_hidden_state
        m = mask.to(hidden.dtype).unsqueeze(-1)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        width = pooled.shape[-1]
        return F.layer_norm(pooled, (width,), eps=1e-5) / math.sqrt(width)

    def forward(self, users, pos, neg, user_ids, user_mask, item_ids, item_mask):
        b = users.shape[0]
        u_id = self.user_id(users)
        i_id = self.item_id(torch.cat([pos, neg]))
        u_text = self.user_text_proj(self.encode(user_ids, user_mask))
        i_text = self.item_text_proj(self.encode(item_ids, item_mask))
        u, items = u_id + u_text, i_id + i_text
        p, n = items[:b], items[b:]
        diff = (u * p).sum(-1, dtype=torch.float32) - (u * n).sum(-1, dtype=torch.float32)
        bpr = -torch.log(1e-10 + torch.sigmoid(diff)).mean()
        l2 = (u_id.float().square().sum() + i_id.float().square().sum()) * (self.l2 / b)
        text = (u_text.float().square().sum() + i_text.float().square().sum()) * (self.text_l2 / b)
        return bpr + l2 + text


class Tables:
    """The token tables on the host: rows cut to the longest real text among them."""

    def __init__(self, t):
        self.ids = {"user": t["user_ids"], "item": t["item_ids"]}
        self.mask = {"user": t["user_mask"], "item": t["item_mask"]}
        self.lengths = {k: v.sum(1).to(torch.long) for k, v in self.mask.items()}

    def rows(self, side, rows):
        longest = max(1, int(self.lengths[side][rows].max()))
        return self.ids[side][rows, :longest], self.mask[side][rows, :longest]


def to_device(tensors, device):
    if device.type != "cuda":
        return tensors
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


def micro_batch(tables, users, pos, neg, device):
    """The model's inputs for one micro batch, on `device`."""
    uids, umask = tables.rows("user", users)
    iids, imask = tables.rows("item", torch.cat([pos, neg]))
    return to_device([users, pos, neg, uids, umask, iids, imask], device)


def autocast(precision, device):
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def parity(model, dump, tables, meta, precision, device):
    """Eval-mode losses on the dumped micro batch: (ours, peer) as dumped and with the probe."""
    batch = load_file(os.path.join(dump, "batch.safetensors"))
    inputs = micro_batch(tables, batch["users"], batch["pos"], batch["neg"], device)
    model.eval()
    with torch.no_grad():
        with autocast(precision, device):
            first = model(*inputs).item()
        saved = {}
        for key, value in batch.items():
            if key.startswith("probe."):
                param = model.get_parameter(key[len("probe."):])
                saved[key] = param.detach().clone()
                param.copy_(value.to(device))
        with autocast(precision, device):
            probe = model(*inputs).item()
        for key, value in saved.items():
            model.get_parameter(key[len("probe."):]).copy_(value)
    model.train()
    return (meta["loss"], first), (meta["loss_probe"], probe)


def flops_per_sample(model, meta, tables, pairs):
    """Real tokens and model FLOPs per training sample (see the header)."""
    g = meta["gpt2"]
    d, n_layer = g["n_embd"], g["n_layer"]
    trained = [any(p.requires_grad for p in block.parameters()) for block in model.gpt2.h]
    per_block = sum(p.numel() for p in model.gpt2.h[0].parameters())
    final = sum(p.numel() for p in model.gpt2.ln_f.parameters())
    n_tr = sum(trained)
    p_tr = n_tr * per_block + (final if model.gpt2.ln_f.weight.requires_grad else 0)
    p_fz = (n_layer - n_tr) * per_block + (0 if model.gpt2.ln_f.weight.requires_grad else final)
    ul, il = tables.lengths["user"].double(), tables.lengths["item"].double()
    warm = il[: meta["n_warm_items"]]
    # One user and one positive per pair, one negative uniform among the warm items.
    tokens = (ul[pairs[:, 0]] + il[pairs[:, 1]]).mean() + warm.mean()
    squares = (ul[pairs[:, 0]] ** 2 + il[pairs[:, 1]] ** 2).mean() + (warm ** 2).mean()
    lin = (6 * p_tr + 2 * p_fz) * tokens
    att = (12 * n_tr + 4 * (n_layer - n_tr)) * d * squares
    return float(tokens), float(lin + att)


def main():
    if len(sys.argv) != 3:
        fail("usage: gpt2_peer.py DUMP_DIR STEPS")
    dump = sys.argv[1]
    try:
        steps = int(sys.argv[2])
        warmup = int(os.environ.get("WARMUP", "3"))
        phase_steps = int(os.environ.get("PHASE_STEPS", str(min(steps, 10))))
    except ValueError:
        fail(f"STEPS {sys.argv[2]!r}, WARMUP and PHASE_STEPS must be whole numbers")
    if steps < 1 or warmup < 0 or phase_steps < 1:
        fail("STEPS and PHASE_STEPS must be >= 1, WARMUP >= 0")
    precision = os.environ.get("PRECISION", "f32")
    if precision not in TOLERANCE:
        fail(f"PRECISION={precision!r}: expected f32, tf32 or bf16")
    on_gpu = os.environ.get("PEER_DEVICE", "cpu") == "cuda"
    if os.environ.get("PEER_DEVICE", "cpu") not in ("cpu", "cuda"):
        fail(f"PEER_DEVICE={os.environ['PEER_DEVICE']!r}: expected cpu or cuda")
    meta_path = os.path.join(dump, "meta.json")
    if not os.path.isfile(meta_path):
        fail(f"{meta_path} is missing: run our worker with GPTREC_DUMP_PEER={dump} first")
    with open(meta_path) as f:
        meta = json.load(f)

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = precision != "f32"
        torch.backends.cudnn.allow_tf32 = precision != "f32"
    if on_gpu:
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    b = meta["batch"]
    global_batch, micro = b["global"], b["micro"]
    if global_batch % (micro * world):
        fail(f"global {global_batch} is not divisible by micro {micro} x world {world}")
    accum = global_batch // (micro * world)

    torch.manual_seed(meta["seed"] + rank)
    model = Recommender(meta)
    model.load_state_dict(load_file(os.path.join(dump, "weights.safetensors")), strict=True)
    trainable = set(meta["trainable"])
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    model.to(device)
    t = load_file(os.path.join(dump, "tables.safetensors"))
    tables, pairs = Tables(t), t["pairs"]

    (ours, peer), (ours_probe, peer_probe) = parity(model, dump, tables, meta, precision, device)
    tol = float(os.environ.get("PARITY_TOL", TOLERANCE_CUDA_F32 if on_gpu and precision == "f32" else TOLERANCE[precision]))
    rel = abs(peer - ours) / max(abs(ours), 1e-12)
    rel_probe = abs(peer_probe - ours_probe) / max(abs(ours_probe), 1e-12)
    ok = rel <= tol and rel_probe <= tol
    if rank == 0:
        print(f"peer parity {precision}: ours {ours:.9f} peer {peer:.9f} diff {peer - ours:.3e} rel {rel:.3e}, "
              f"probe: ours {ours_probe:.9f} peer {peer_probe:.9f} diff {peer_probe - ours_probe:.3e} rel {rel_probe:.3e} "
              f"(tolerance {tol:.0e}): {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        fail(f"the peer's loss differs from ours by more than {tol:.0e} relative: the two do not compute the same thing")

    ddp = DDP(model, device_ids=[device.index] if on_gpu else None)
    params = [p for p in model.parameters() if p.requires_grad]
    c = meta["train"]
    opt = torch.optim.AdamW(params, lr=c["lr"], betas=tuple(c["betas"]), eps=c["eps"],
                            weight_decay=c["weight_decay"], fused=on_gpu or None)
    order_gen = torch.Generator().manual_seed(meta["seed"])
    neg_gen = torch.Generator().manual_seed(meta["seed"] * 1_000_003 + rank)
    n_warm_items = meta["n_warm_items"]
    per_rank = len(pairs) // world
    if per_rank < micro * accum:
        fail(f"{len(pairs)} training pairs are fewer than one global batch of {global_batch}")
    order, at = None, per_rank

    def next_indices():
        """The next micro batch of this rank's shard of a fresh permutation per epoch."""
        nonlocal order, at
        if at + micro > per_rank:
            perm = torch.randperm(len(pairs), generator=order_gen)
            order, at = perm[rank:per_rank * world:world], 0
        at += micro
        return order[at - micro:at]

    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)

    def step(phases):
        """One optimizer step; with `phases`, its time by phase added there (synchronised)."""
        loss = None
        for a in range(accum):
            t0 = time.perf_counter()
            idx = next_indices()
            users, pos = pairs[idx, 0], pairs[idx, 1]
            neg = torch.randint(0, n_warm_items, (micro,), generator=neg_gen)
            inputs = micro_batch(tables, users, pos, neg, device)
            if phases is not None:
                sync()
                t1 = time.perf_counter()
                phases["data"] += t1 - t0
            with ddp.no_sync() if a + 1 < accum else contextlib.nullcontext():
                with autocast(precision, device):
                    loss = ddp(*inputs) / accum
                if phases is not None:
                    sync()
                    t2 = time.perf_counter()
                    phases["forward"] += t2 - t1
                loss.backward()
            if phases is not None:
                sync()
                phases["backward"] += time.perf_counter() - t2
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, c["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if phases is not None:
            sync()
            phases["optimizer"] += time.perf_counter() - t3
        return loss

    for _ in range(warmup):
        step(None)
    sync()
    dist.barrier()
    phases = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    t0 = time.perf_counter()
    for _ in range(steps):
        # On the CPU synchronising costs nothing: the timed steps give the phases too.
        loss = step(None if on_gpu else phases)
    sync()
    dist.barrier()
    seconds = time.perf_counter() - t0
    phase_count, synced = steps, None
    if on_gpu:
        phases = {k: 0.0 for k in phases}
        t1 = time.perf_counter()
        for _ in range(phase_steps):
            loss = step(phases)
        synced = phase_steps * global_batch / (time.perf_counter() - t1)
        phase_count = phase_steps
    last = loss.item() * accum
    if rank == 0:
        tokens, flops = flops_per_sample(model, meta, tables, pairs)
        ms = {k: v * 1000.0 / phase_count for k, v in phases.items()}
        print(f"peer samples/s {steps * global_batch / seconds:.1f}", flush=True)
        if synced is not None:
            print(f"peer samples/s synchronised per phase {synced:.1f}", flush=True)
        print(f"peer ms/step data {ms['data']:.3f} forward {ms['forward']:.3f} backward {ms['backward']:.3f} "
              f"optimizer {ms['optimizer']:.3f} (mean over {phase_count} steps after {warmup} warm-up steps"
              f"{', synchronised per phase' if on_gpu else ''}; all-reduce inside backward)", flush=True)
        print(f"peer tokens/sample {tokens:.2f}, flops/sample {flops:.4e}", flush=True)
        print(f"peer last loss {last:.6f} after {warmup + steps + (phase_steps if on_gpu else 0)} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
