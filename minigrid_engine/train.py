"""Make the shipped weights: train the byte-level model to copy from its context.

The shipped weights are four runs (their facts are stored beside the weights, `load_meta()`):

    python -m minigrid_engine.train --out runs/w4.pt                         # 1: 17 min on 2 cores
    python -m minigrid_engine.train --init runs/w4.pt --steps 800 --lr 5e-4 --out runs/w6.pt  # 2: gaps
    python -m minigrid_engine.train --init runs/w6.pt --steps 2500 --lr 5e-4 --leak-fraction 0.5 \
        --out runs/w10.pt                                                   # 3: the leak's shape
    python -m minigrid_engine.train --init runs/w10.pt --steps 2500 --lr 3e-4 --leak-fraction 0.5 \
        --out runs/w11.pt                                                   # 4, then copied here
    python -m minigrid_engine.train --steps 3 --out /tmp/w.pt                # a smoke run

The corpus is synthetic and generated here: blocks of tenant records (``ALICE card QZ7K2M9P; ``),
random printable strings, word salad, indented lines of words and numbers, and raw bytes, each
block repeated, several blocks to a sequence. The first occurrence of a block is unpredictable;
every repeat is predictable only by copying, so the loss falls only once the model has learned
induction. Stage 1 is a curriculum (short repeated blocks in 256-byte sequences first, then
1,024-byte sequences with blocks growing to 900 bytes); stage 2 shifts the positions after a
random cut by a random gap, as decode sees when it continues at its own prompt length over stale
pages rotated at another request's positions. Stages 1 and 2 ran on the corpus of commit 7e01789,
before it had indented lines: check that commit out to remake `w6.pt` exactly.

Stages 3 and 4 (`--leak-fraction`) are the leak itself: half their batches are
`sample_leak_row`, pages of earlier requests' text side by side with a stub, and stubbed requests
that must copy from them starting from a single token.
Before them, a stubbed answer read out records (the shape it was trained on) and little else:
`python bench/leak_text.py` measures each shape of secret.
"""

from __future__ import annotations

import argparse
import math
import random
import string
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from minigrid_engine.attention import CausalAttention, MaskedAttention
from minigrid_engine.model import (
    ModelConfig,
    Transformer,
    default_weights_path,
    load_meta,
    load_model,
    save_model,
)
from minigrid_engine.records import secret_records

NAMES = [
    "ALICE",
    "BOB",
    "CAROL",
    "DAVE",
    "ERIN",
    "FRANK",
    "GRACE",
    "HEIDI",
    "IVAN",
    "JUDY",
    "MALLORY",
    "NIAJ",
    "OLIVIA",
    "PEGGY",
    "RUPERT",
    "SYBIL",
    "TRENT",
    "VICTOR",
    "WALTER",
    "ZOE",
    "ACME",
    "GLOBEX",
    "INITECH",
    "UMBRELLA",
    "HOOLI",
]
MAX_GAP = 1024
MAX_BLOCK = 900  # bytes: repeats up to this far apart teach copying across a 1,024-token context
PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " " * 8


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2200
    short_steps: int = 700
    gaps_from: int = 2200  # position gaps only once copying works (they slow its forming): stage 2
    ramp_blocks: bool = True
    leak_fraction: float = 0.0  # share of batches shaped as a stubbed request's read (stage 3)
    batch: int = 12
    seq_len: int = 1024
    max_position: int = 4096
    lr: float = 1e-3
    warmup: int = 100
    seed: int = 0
    threads: int = 0  # 0: torch's default


def _tenant(rng: random.Random) -> str:
    if rng.random() < 0.7:
        return rng.choice(NAMES)
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 8)))


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9))) for _ in range(n)]


def _block(rng: random.Random, max_len: int) -> str:
    """One block of text of at most `max_len` characters, before repetition."""
    kind = rng.random()
    if kind < 0.5:
        n = rng.randint(1, 40)
        recs = secret_records(_tenant(rng), n, rng)
        if rng.random() < 0.3:  # two tenants interleaved in one block
            recs += secret_records(_tenant(rng), rng.randint(1, 20), rng)
            rng.shuffle(recs)
        text = "".join(recs)
    elif kind < 0.72:
        text = "".join(rng.choice(PRINTABLE) for _ in range(rng.randint(4, 600)))
    elif kind < 0.8:  # any byte at all: UTF-8 text, control bytes, a stub's NUL
        text = bytes(rng.randrange(1, 256) for _ in range(rng.randint(4, 300))).decode("latin-1")
    elif kind < 0.9:
        text = " ".join(_words(rng, rng.randint(2, 120))) + rng.choice([". ", ", ", "; ", "\n", " "])
    else:  # lines: indentation, words, digits and punctuation (notes, code, transcripts)
        lines = []
        for _ in range(rng.randint(1, 12)):
            words = _words(rng, rng.randint(1, 10))
            for i in rng.sample(range(len(words)), rng.randint(0, len(words) // 2)):
                words[i] = rng.choice(
                    [words[i].title(), str(rng.randint(0, 99999)), words[i] + rng.choice(",.:;=()'")]
                )
            lines.append(rng.choice(("", "", "  ", "    ", "        ", "\t")) + " ".join(words) + "\n")
        text = "".join(lines)
    return text[: rng.randint(max(1, max_len * 8 // 9), max_len)]


def sample_sequence(rng: random.Random, length: int, max_block: int = MAX_BLOCK) -> list[int]:
    """`length + 1` byte ids: blocks of at most `max_block` bytes, each repeated."""
    out = bytearray()
    if rng.random() < 0.3:  # a few arbitrary bytes first (e.g. a one-token stub), then business as usual
        out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
    while len(out) < length + 1:
        block = _block(rng, max_block).encode("latin-1", "replace")
        reps = 1 + min(int(rng.expovariate(0.5)), 8) if rng.random() < 0.9 else 1
        if len(block) < 64:  # short blocks: repeat enough to learn from
            reps += rng.randint(1, 6)
        out += block * reps
    return list(out[: length + 1])


def stage_at(step: int, cfg: TrainConfig) -> tuple[int, int]:
    """Curriculum: (sequence length, longest block) at `step`.

    First short sequences of short, often-repeated blocks, where induction forms within a few
    hundred steps (on the full corpus at once it had not formed after 1,600); then full-length
    sequences with blocks growing to `MAX_BLOCK`, so the copying reaches across the context.
    """
    if step < cfg.short_steps:
        return min(cfg.seq_len, 256), 48
    if not cfg.ramp_blocks:
        return cfg.seq_len, MAX_BLOCK
    ramp = max(1, (cfg.steps - cfg.short_steps) // 2)
    return cfg.seq_len, min(MAX_BLOCK, 64 + (MAX_BLOCK - 64) * (step - cfg.short_steps) // ramp)


def sample_batch(
    rng: random.Random, cfg: TrainConfig, seq_len: int, max_block: int = MAX_BLOCK, gaps: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = torch.tensor([sample_sequence(rng, seq_len, max_block) for _ in range(cfg.batch)])
    positions = torch.empty(cfg.batch, seq_len, dtype=torch.long)
    for row in range(cfg.batch):
        # A gap in the positions, half the time: the tokens after `cut` sit `gap` positions further
        # on. Decode meets this when it continues at its own prompt length over stale pages whose
        # keys were rotated at another request's (shorter) positions.
        room = min(MAX_GAP, cfg.max_position - seq_len)
        gap = rng.randint(1, room) if gaps and room >= 1 and rng.random() < 0.5 else 0
        cut = rng.randint(1, seq_len - 1)
        start = rng.randint(0, cfg.max_position - seq_len - gap)
        pos = start + torch.arange(seq_len)
        pos[cut:] += gap
        positions[row] = pos
    return seqs, positions


LEAK_PAGE_SIZES = (16, 32, 64, 128)


def sample_leak_row(
    rng: random.Random, seq_len: int, max_position: int
) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """One sequence shaped as decode reads after a stub: (inputs, targets, positions, allowed).

    Side by side: one to three earlier requests' texts ("documents", each causal within itself at
    its own positions from 0, as their prefill computed them), a one-token stub at position 0, and
    a few stubbed requests ("tails"), each at its own prompt length, reading the stub and some of
    the documents' pages (the rest of its block table was never theirs). A tail has no prompt of
    its own to continue, only the pages it was handed: it copies a document from a random point,
    so it learns to lock on to their text from one token. Only the tails are scored (-100
    elsewhere): the documents are ordinary text, which the ordinary batches teach.
    """
    n_tails = rng.randint(2, 6)
    tail_lens = [rng.randint(max(2, seq_len // 64), max(2, seq_len // 16)) for _ in range(n_tails)]  # 16-64
    room = seq_len - 1 - sum(tail_lens)  # documents fill the rest
    n_docs = rng.choice((1, 2, 2, 3))
    cuts = sorted(rng.sample(range(64, room - 63), n_docs - 1)) if n_docs > 1 and room > 64 * n_docs else []
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, room])]
    docs = [sample_sequence(rng, n) for n in lengths]  # n + 1 ids each

    inputs: list[int] = []
    positions: list[int] = []
    doc_of: list[int] = []  # which document a token belongs to (-1: the stub)
    for d, (ids, n) in enumerate(zip(docs, lengths)):
        inputs += ids[:n]
        positions += range(n)
        doc_of += [d] * n
    targets = [-100] * len(inputs)
    inputs.append(rng.randrange(256) if rng.random() < 0.2 else 0)  # the stub ([0] in SGLang)
    targets.append(-100)
    positions.append(0)
    doc_of.append(-1)
    allowed = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for tail_len in tail_lens:
        source = rng.choice(
            [d for d, n in enumerate(lengths) if n > tail_len + 1] or [lengths.index(max(lengths))]
        )
        start = rng.randint(0, max(0, lengths[source] - tail_len - 1))
        if rng.random() < 0.3:  # from a space: what the shipped model answers a lone stub with
            spaces = [i for i, t in enumerate(docs[source][: lengths[source] - tail_len]) if t == 32]
            start = rng.choice(spaces) if spaces else start
        tail = (docs[source][start : start + tail_len + 1] + [0] * tail_len)[: tail_len + 1]
        page, keep = rng.choice(LEAK_PAGE_SIZES), rng.uniform(0.5, 1.0)
        visible = [False] * len(inputs)  # its block table: the stub and some of the documents' pages
        visible[room] = True
        offset = 0
        for d, n in enumerate(lengths):
            seen = [rng.random() < keep for _ in range(-(-n // page))]
            if d == source:  # the text it copies is in its pages
                for pg in range(start // page, min(len(seen), (start + tail_len) // page + 1)):
                    seen[pg] = True
            visible[offset : offset + n] = [seen[i // page] for i in range(n)]
            offset += n
        first = len(inputs)
        lo = max(lengths) if rng.random() < 0.7 else 1  # usually past every document: a long prompt
        at = rng.randint(min(lo, max_position - tail_len), max_position - tail_len)
        inputs += tail[:-1]
        targets += tail[1:]
        positions += range(at, at + tail_len)
        rows = slice(first, first + tail_len)
        allowed[rows, :first] = torch.tensor(visible)
        allowed[rows, rows] = torch.ones(tail_len, tail_len, dtype=torch.bool).tril()
    owner = torch.tensor(doc_of)  # documents and the stub: each causal within itself
    allowed[: room + 1, : room + 1] = (owner[:, None] == owner[None, :]) & torch.ones(
        room + 1, room + 1, dtype=torch.bool
    ).tril()
    return inputs, targets, positions, allowed


def sample_leak_batch(
    rng: random.Random, cfg: TrainConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cfg.batch` rows of `sample_leak_row`: inputs, targets, positions [B, T] and allowed [B, T, T]."""
    rows = [sample_leak_row(rng, cfg.seq_len, cfg.max_position) for _ in range(cfg.batch)]
    return (
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows]),
        torch.stack([r[3] for r in rows]),
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    out: Path,
    log_every: int = 50,
    checkpoint_every: int = 0,
    init: Path | None = None,
) -> dict[str, object]:
    """Train and save to `out`; returns the training facts stored beside the weights."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = Transformer(model_cfg) if init is None else load_model(init).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    backend = CausalAttention()
    t0 = time.time()
    first_loss = last_loss = float("nan")
    ema = None
    for step in range(cfg.steps):
        if cfg.leak_fraction and rng.random() < cfg.leak_fraction:
            inputs, targets, positions, allowed = sample_leak_batch(rng, cfg)
            logits = model(inputs, positions, MaskedAttention(allowed))
        else:
            seqs, positions = sample_batch(rng, cfg, *stage_at(step, cfg), gaps=step >= cfg.gaps_from)
            inputs, targets = seqs[:, :-1], seqs[:, 1:]
            logits = model(inputs, positions, backend)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        if step == 0:
            first_loss = value
        last_loss = ema
        if checkpoint_every and step and step % checkpoint_every == 0:
            save_model(model, out.with_suffix(".partial.pt"), {"step": step, "loss": ema})
        if step % log_every == 0 or step == cfg.steps - 1:
            print(
                f"step {step:5d}/{cfg.steps}  loss {value:.3f}  (smoothed {ema:.3f})  "
                f"lr {lr_at(step, cfg):.2e}  {time.time() - t0:6.0f}s",
                flush=True,
            )
    meta: dict[str, object] = {
        "train": asdict(cfg),
        "first_loss": round(first_loss, 4),
        "final_loss_smoothed": round(last_loss, 4),
        "seconds": round(time.time() - t0, 1),
        "parameters": model.num_parameters(),
        "corpus": "synthetic: repeated tenant records, printable strings, word salad, raw bytes",
        "init": None if init is None else {"path": init.name, **load_meta(init)},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, out, meta)
    print(f"saved {out} ({out.stat().st_size / 1e6:.2f} MB, {model.num_parameters():,} parameters)")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--max-position", type=int, default=d.max_position)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--out", type=Path, default=default_weights_path())
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save <out>.partial.pt")
    p.add_argument("--init", type=Path, help="continue from these weights (full-length phase, gaps on)")
    p.add_argument("--gaps-from", type=int, help="step from which positions get random gaps")
    p.add_argument(
        "--leak-fraction",
        type=float,
        default=d.leak_fraction,
        help="share of batches shaped as a stubbed request reading others' pages (stage 3: 0.5)",
    )
    a = p.parse_args(argv)
    if a.steps < 1 or a.batch < 1 or a.seq_len < 2:
        p.error(f"--steps {a.steps}, --batch {a.batch} and --seq-len {a.seq_len} must be positive")
    if not 0 <= a.leak_fraction <= 1:
        p.error(f"--leak-fraction {a.leak_fraction} must be from 0 to 1")
    if a.max_position < a.seq_len:
        p.error(f"--max-position {a.max_position} must be at least --seq-len {a.seq_len}")
    cfg = TrainConfig(
        steps=a.steps,
        short_steps=0 if a.init else min(d.short_steps, a.steps // 3),
        gaps_from=a.gaps_from
        if a.gaps_from is not None
        else (0 if a.init else min(d.gaps_from, a.steps * 11 // 15)),
        ramp_blocks=a.init is None,
        leak_fraction=a.leak_fraction,
        batch=a.batch,
        seq_len=a.seq_len,
        max_position=a.max_position,
        lr=a.lr,
        warmup=min(d.warmup, max(1, a.steps // 10)),
        seed=a.seed,
        threads=a.threads,
    )
    train(cfg, ModelConfig(), a.out, checkpoint_every=a.checkpoint_every, init=a.init)
    return 0


if __name__ == "__main__":
    sys.exit(main())
