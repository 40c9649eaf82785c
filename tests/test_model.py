"""The shipped model copies from its context, through the paged cache, and nowhere else."""

from __future__ import annotations

import random
import re

import pytest
import torch

from minigrid_engine.canary import longest_shared_run
from minigrid_engine.config import incident_preset
from minigrid_engine.engine import Engine
from minigrid_engine.inprocess import InProcessCluster
from minigrid_engine.model import load_meta, load_model
from minigrid_engine.pool import PoolConfig
from minigrid_engine.records import record_prompt, shaped_prompt
from minigrid_engine.request import Outcome
from minigrid_engine.runner import DecodeItem, ModelRunner, sample, sampling_generator
from minigrid_engine.scenario import codes_in

CODE = re.compile(r"\b[A-Z0-9]{6,10}\b")


@pytest.fixture(scope="module")
def model():
    return load_model()


def codes(text: str, tenant: str) -> set[str]:
    """The codes of `tenant`'s records in `text` (``TENANT field CODE;``)."""
    return set(re.findall(rf"{tenant.upper()} [a-z]+ ([A-Z0-9]{{6,10}});", text))


def continuation(prompt: str, n: int) -> str:
    """What copying would produce: the prompt's repeated block, continued."""
    block_end = prompt.index(prompt[:24], 1)  # record_prompt repeats one block
    block = prompt[:block_end]
    full = block * (len(prompt) // len(block) + 3)
    return full[len(prompt) : len(prompt) + n]


def test_weights_are_small_and_documented() -> None:
    meta = load_meta()
    assert meta["parameters"] < 2_000_000
    root = meta  # follow fine-tuning back to the run that started from random weights
    while root.get("init"):
        root = root["init"]  # type: ignore[assignment]
    assert float(root["first_loss"]) > 5  # about ln(256): random weights
    assert float(meta["final_loss_smoothed"]) < float(root["first_loss"]) / 2


@pytest.mark.parametrize(
    ("seed", "n_tokens", "n_records"), [(11, 200, 3), (12, 420, 6), (13, 700, 10), (14, 900, 12)]
)
def test_model_copies_records_from_its_context(model, seed: int, n_tokens: int, n_records: int) -> None:
    """Greedy decoding continues with the prompt's records, spaces included (a small model may jump
    between records that share a prefix, but it copies them whole and invents none)."""
    rng = random.Random(seed)
    tenant = rng.choice(["alice", "bob", "zed", "mallory"])
    prompt = record_prompt(tenant, n_tokens, rng, n_records)
    engine = Engine(model=model, pool=PoolConfig(2048, 128), context_length=1024)
    [done] = engine.generate(tenant, [prompt], max_tokens=64)
    assert done.outcome is Outcome.LENGTH
    cut = done.text.index("; ") + 2  # the end of the record the prompt stopped in
    first = prompt[prompt.rindex("; ") + 2 :] + done.text[:cut]
    assert first in prompt, f"{done.text!r} does not finish the prompt's last record with one of its records"
    records = re.findall(r"[A-Z]+ [a-z]+ [A-Z0-9]+; ", done.text[cut:])
    assert len(records) >= 2, f"{done.text!r} holds fewer than two whole records"
    assert all(r in prompt for r in records), f"{done.text!r} holds records not in the prompt"


def test_each_answer_draws_only_from_its_own_prompt(model) -> None:
    """Several tenants in one decode batch, after others left stale pages behind."""
    rng = random.Random(7)
    engine = Engine(model=model, pool=PoolConfig(4096, 64), context_length=1024)
    stale = [record_prompt(t, 500, rng, 8) for t in ("carol", "dave")]
    engine.generate("carol", stale[:1], max_tokens=8)
    engine.generate("dave", stale[1:], max_tokens=8)
    prompts = {
        t: record_prompt(t, rng.randint(250, 600), rng, rng.randint(3, 8)) for t in ("alice", "bob", "erin")
    }
    reqs = {t: engine.submit(t, p, max_tokens=64) for t, p in prompts.items()}
    engine.step()
    assert len(engine.running) == 3  # decoding together, one batch
    engine.run()
    others = {t: codes(p, t) for t, p in prompts.items()} | {
        "carol": codes(stale[0], "carol"),
        "dave": codes(stale[1], "dave"),
    }
    for tenant, req in reqs.items():
        text = engine.tokenizer.decode(req.output_ids)
        found = set(CODE.findall(text))
        foreign = {c for t, cs in others.items() if t != tenant for c in cs} & found
        assert not foreign, f"{tenant}'s answer {text!r} holds other tenants' codes {foreign}"
        assert codes(text, tenant), f"{tenant}'s answer {text!r} copied none of its own records"
    engine.pool.check_integrity()
    assert engine.pool.pages_in_use == 0


def test_stale_block_table_leaks_the_previous_owners_text(model) -> None:
    """The incident's mechanism in one process: B attends over pages A wrote and left behind."""
    rng = random.Random(3)
    engine = Engine(model=model, pool=PoolConfig(2048, 128), context_length=1024)
    alice_prompt = record_prompt("alice", 640, rng, 9)
    [a] = engine.generate("alice", [alice_prompt], max_tokens=8)
    assert a.outcome is Outcome.LENGTH
    alice_codes = codes(alice_prompt, "alice")

    # Bob's real prompt is 640 tokens long, but only a one-token stub was ever prefilled.
    pool, runner = engine.pool, ModelRunner(model, engine.pool)
    bob = pool.reserve("bob-1", "bob", 640 + 32)
    assert bob.pages[:5] == list(pool.trace.events(kind="release")[-1].pages[:5])  # alice's pages, reused
    logits = runner.prefill("bob-1", "bob", [0], bob.pages)  # writes one slot of page 0
    out = [sample(logits, 0.0)]
    for step in range(40):
        item = DecodeItem("bob-1", "bob", out[-1], 640 + step, bob.pages)
        out.append(sample(runner.decode([item])[0], 0.0))
    text = engine.tokenizer.decode(out)
    leaked = set(CODE.findall(text)) & alice_codes
    assert leaked, f"bob's answer {text!r} should hold alice's codes"
    writers = {pool.pages[p].last_writer for p in bob.pages[1:5]}
    assert writers == {a.request_id}, "pages 2-5 of bob's block table were last written by alice"
    pool.release("bob-1")
    pool.check_integrity()


@pytest.mark.parametrize("shape", ["letter", "code"])
def test_a_stubbed_answer_reads_out_text_in_shapes_never_trained_on(model, shape: str) -> None:
    """The leak is text a learner reads whatever alice wrote, not only the records the model was
    trained on: the incident on the in-process cluster, alice's prompts a letter or code
    (`records.shaped_prompt`), bob's stubbed answer copies a run of her text that his own prompt
    does not hold. (Before the leak-shaped training phase: 2 of 20 letters, 0 of 20 code; chat
    transcripts are still rarely read out: `bench/leak_text.py` measures each shape.)"""
    runs = []
    for trial in range(8):
        rng = random.Random(100 + trial)
        cluster = InProcessCluster(incident_preset(), model)
        alice = [shaped_prompt("alice", shape, 520, rng) for _ in range(2)]
        for prompt in alice:
            cluster.submit("alice", prompt, max_tokens=40)
        cluster.run()
        bob = shaped_prompt("bob", rng.choice(["records", "letter", "code", "chat"]), 940, rng)
        text = cluster.text(cluster.complete("bob", bob, max_tokens=40))
        runs.append((longest_shared_run(text, "\x00".join(alice), exclude=bob), text))
    readable = [text for run, text in runs if run >= 12]
    assert len(readable) >= 3, f"too few of bob's answers read out alice's {shape}: {runs}"


def test_same_pages_same_answer_whatever_the_page_size(model) -> None:
    rng = random.Random(5)
    prompt = record_prompt("judy", 300, rng, 5)
    texts = set()
    for page in (16, 64, 128):
        engine = Engine(model=model, pool=PoolConfig(1024, page), context_length=1024)
        texts.add(engine.generate("judy", [prompt], max_tokens=24)[0].text)
    assert len(texts) == 1
    (text,) = texts
    assert "JUDY" in text and codes_in(text) & codes_in(prompt), text  # her records, copied


def test_sampling_is_seeded(model) -> None:
    engine = Engine(model=model, pool=PoolConfig(1024, 128), context_length=512)
    a = engine.submit("t", "hello world. hello world. ", max_tokens=12, temperature=1.0, seed=4)
    b = engine.submit("t", "hello world. hello world. ", max_tokens=12, temperature=1.0, seed=4)
    engine.run()
    assert a.output_ids == b.output_ids
    assert torch.is_grad_enabled()
    others = [
        engine.submit("t", "hello world. hello world. ", max_tokens=12, temperature=1.0, seed=s)
        for s in range(6)
    ]
    greedy = engine.submit("t", "hello world. hello world. ", max_tokens=12)
    engine.run()
    samples = {bytes(r.output_ids) for r in others}
    assert len(samples) > 1 and samples != {bytes(greedy.output_ids)}, (
        samples
    )  # the seed draws, it is not greedy


def test_a_stop_text_ends_the_answer_and_frees_its_pages(model) -> None:
    engine = Engine(model=model, pool=PoolConfig(1024, 128), context_length=512)
    prompt = "ZED pin 7Q2M4K; ZED card PX81KQ0A; " * 4
    [whole] = engine.generate("zed", [prompt], max_tokens=30)
    [cut] = engine.generate("zed", [prompt], max_tokens=30, stop=["; ", "never"])
    assert whole.outcome is Outcome.LENGTH and "; " in whole.text
    assert cut.outcome is Outcome.STOP and whole.text.startswith(cut.text + "; "), (whole.text, cut.text)
    assert engine.pool.pages_in_use == 0


def test_bad_token_ids_and_seeds_are_refused_before_any_page_is_reserved(model) -> None:
    from minigrid_engine.errors import BadInput

    engine = Engine(model=model, pool=PoolConfig(512, 128), context_length=256)
    for prompt, seed, message in [
        ([72, 999], None, "prompt holds 999 at index 1: token ids are whole numbers from 0 to 255"),
        ([72, -1], None, "prompt holds -1 at index 1"),
        ([72, True], None, "prompt holds True at index 1"),
        ("hi", 2**64, "'seed' must be a 64-bit signed integer"),
        ("hi", 1.5, "'seed' must be an integer, got 1.5"),
    ]:
        with pytest.raises(BadInput, match=re.escape(message)):
            engine.submit("t", prompt, max_tokens=4, temperature=1.0, seed=seed)
    assert engine.pool.pages_in_use == 0 and not engine.waiting


def test_a_prefill_that_fails_gives_its_pages_back(model, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(model=model, pool=PoolConfig(512, 128), context_length=256)
    req = engine.submit("t", "hello world. " * 4, max_tokens=4)

    def broken(*args: object) -> None:
        raise RuntimeError("out of device memory")

    monkeypatch.setattr(engine.runner, "prefill", broken)
    with pytest.raises(RuntimeError, match="out of device memory"):
        engine.run()
    assert engine.pool.pages_in_use == 0 and engine.pool.holders() == []  # no page owned by nobody
    assert req.outcome is Outcome.ABORTED and not engine.waiting and not engine.running
    engine.pool.check_integrity()
    monkeypatch.undo()
    [done] = engine.generate("t", ["hello world. " * 4], max_tokens=4)  # the engine goes on
    assert done.outcome is Outcome.LENGTH and len(done.token_ids) == 4


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_draws_from_softmax_of_the_logits_over_the_temperature(temperature: float) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    want = torch.softmax(logits.double() / temperature, -1)
    gen = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(logits, temperature, gen) for _ in range(n)]), minlength=3)
    # 4,000 draws: each frequency within 4 standard deviations of its probability
    assert torch.all((counts / n - want).abs() <= 4 * (want * (1 - want) / n).sqrt()), (counts, want)
    assert sample(logits, 0.0) == 2 and sample(logits, 1e-300, gen) == 2  # greedy, and its limit


def test_a_seeds_two_sampling_streams_and_nearby_seeds_draw_apart() -> None:
    first = [torch.rand(4, generator=sampling_generator(s, stream)) for s, stream in ((7, 0), (7, 1), (8, 0))]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    again = torch.rand(4, generator=sampling_generator(7, 0))
    assert torch.equal(first[0], again)
    # seeds 2**32 apart: torch keeps 32 bits of a seed it is given; the hash keeps all 64
    assert not torch.equal(
        torch.rand(4, generator=sampling_generator(5, 0)),
        torch.rand(4, generator=sampling_generator(5 + 2**32, 0)),
    )


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "says"),
    [
        (200, 40, "= 240 exceeds the KV pool of 224 tokens"),
        (1000, 40, "= 1040 exceeds the context length of 1024"),
        (200, 24, None),
    ],
)
def test_the_one_process_engine_refuses_what_its_pool_or_context_cannot_hold(
    model, prompt_tokens: int, max_tokens: int, says: str | None
) -> None:
    engine = Engine(model=model, pool=PoolConfig(224, 16), context_length=1024)  # 14 pages of 16
    req = engine.submit("t", "x" * prompt_tokens, max_tokens=max_tokens)
    engine.run()  # returns: nothing waits for pages that can never come
    if says is None:  # 224 tokens exactly: it fits
        assert req.outcome is Outcome.LENGTH and len(req.output_ids) == 24
    else:
        assert req.outcome is Outcome.REJECTED and says in (req.error or ""), req.error
    assert engine.pool.pages_in_use == 0


def test_the_one_process_engine_runs_at_most_max_batch_requests_at_once(model) -> None:
    engine = Engine(model=model, pool=PoolConfig(2048, 16), context_length=512, max_batch=2)
    reqs = [engine.submit("t", f"ALICE card QZ7K2M9{i}; " * 3, max_tokens=6) for i in range(3)]
    most = 0
    while engine.waiting or engine.running:
        engine.step()
        most = max(most, len(engine.running))
    assert most == 2 and all(r.outcome is Outcome.LENGTH for r in reqs)
