"""Secret records: the text tenants put in their prompts, and the shape the model learns to copy.

A record reads like ``ALICE card QZ7K2M9P; ``: a tenant's name, a field and a random code. The
codes are random, so a code showing up in another tenant's answer can only have come from
reading the owner's KV pages.
"""

from __future__ import annotations

import random
import re
import string

FIELDS = ("card", "iban", "pin", "key", "token", "phone", "pass", "acct", "vault", "badge")
CODE_ALPHABET = string.ascii_uppercase + string.digits
RECORD = re.compile(r"([A-Z]+) ([a-z]+) ([A-Z0-9]{6,10});")
CUT_RECORD = re.compile(r"[A-Z]+ [a-z]+ ([A-Z0-9]+)$")  # a last record whose code the end cut


def random_code(rng: random.Random, length: int = 8) -> str:
    """A random code such as ``QZ7K2M9P``."""
    return "".join(rng.choice(CODE_ALPHABET) for _ in range(length))


def secret_records(tenant: str, n: int, rng: random.Random) -> list[str]:
    """`n` distinct records of `tenant`, each ending with ``"; "``."""
    name = tenant.upper()
    return [f"{name} {rng.choice(FIELDS)} {random_code(rng, rng.randint(6, 10))}; " for _ in range(n)]


def record_prompt(tenant: str, n_tokens: int, rng: random.Random, n_records: int = 8) -> str:
    """A prompt of exactly `n_tokens` bytes: `n_records` of `tenant`'s records, repeated.

    The repetition is what lets a small model continue the records; the last record may be cut.
    """
    block = "".join(secret_records(tenant, n_records, rng))
    text = (block * (n_tokens // len(block) + 1))[:n_tokens]
    return text


# -- secrets in other shapes: what real tenants paste, which the model was never trained on ------
FIRST_NAMES = ("Maria", "Jean", "Aiko", "Omar", "Lena", "Pavel", "Chloe", "Ravi", "Sofia", "Tomas")
LAST_NAMES = ("Lopez", "Martin", "Tanaka", "Haddad", "Berg", "Novak", "Dubois", "Patel", "Rossi", "Kral")
CITIES = ("Lisbon", "Oslo", "Lyon", "Austin", "Osaka", "Porto", "Graz", "Leeds")


def _letter(tenant: str, rng: random.Random, secrets: list[str]) -> str:
    person = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    insurance, account, password = random_code(rng, 9), random_code(rng, 10), random_code(rng, 8).lower()
    lines = [
        f"Patient {person}, born 19{rng.randint(40, 99)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}, "
        f"insurance number {insurance}. ",
        f"Please wire {rng.randint(10, 900)},000 EUR to account {account} before Friday. ",
        f"The password for the {rng.choice(CITIES)} server is {password}, do not share it. ",
        f"Dear {person}, the {tenant.title()} merger closes on March {rng.randint(1, 28)} at "
        f"{rng.randint(10, 99)} dollars a share. ",
    ]
    secrets += [insurance, account, password]
    rng.shuffle(lines)
    return "".join(lines[: rng.randint(2, 4)])


def _code(tenant: str, rng: random.Random, secrets: list[str]) -> str:
    verb, key = rng.choice(("transfer", "charge", "refund", "sync", "export")), random_code(rng, 12).lower()
    secrets.append(key)
    return (
        f"def {verb}_{tenant.lower()}(account, amount):\n"
        f"    api_key = 'sk-live-{key}'\n"
        f"    return bank.{verb}(account, amount, key=api_key)\n\n"
    )


def _chat(tenant: str, rng: random.Random, secrets: list[str]) -> str:
    wifi = f"{random_code(rng, 6).lower()}-{rng.randint(100, 999)}"
    secrets.append(wifi)
    return (
        f"user: what is the wifi password at the {rng.choice(CITIES)} office?\n"
        f"assistant: it is {wifi}, {tenant.title()} staff only.\n"
    )


SHAPES = {"letter": _letter, "code": _code, "chat": _chat}


def shaped_prompt(
    tenant: str, shape: str, n_tokens: int, rng: random.Random, secrets: list[str] | None = None
) -> str:
    """A prompt of exactly `n_tokens` bytes of `tenant`'s secrets in one of `SHAPES` (prose with
    names and numbers, source code with a key, a chat transcript) or ``"records"``: pieces drawn
    afresh until it is long enough, then cut. The model's training corpus holds records, random
    strings, word salad and indented lines, none of the others. `secrets`, when given, receives
    the secret values (codes, passwords, keys) the prompt holds, whole or cut at its end."""
    if shape not in ("records", *SHAPES):
        raise ValueError(f"unknown shape {shape!r}: one of records, {', '.join(SHAPES)}")
    found: list[str] = []
    if shape == "records":
        text = record_prompt(tenant, n_tokens, rng, rng.randint(4, 10))
        found = [code for _, _, code in RECORD.findall(text)]
        found += CUT_RECORD.findall(text)
    else:
        text = ""
        while len(text) < n_tokens:
            text += SHAPES[shape](tenant, rng, found)
        text = text[:n_tokens]
    if secrets is not None:
        secrets += [s for s in found if s[:6] in text]
    return text
