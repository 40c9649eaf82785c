"""Secret records: the text tenants put in their prompts, and the shape the model learns to copy.

A record reads like ``ALICE card QZ7K2M9P; ``: a tenant's name, a field and a random code. The
codes are random, so a code showing up in another tenant's answer can only have come from
reading the owner's KV pages.
"""

from __future__ import annotations

import random
import string

FIELDS = ("card", "iban", "pin", "key", "token", "phone", "pass", "acct", "vault", "badge")
CODE_ALPHABET = string.ascii_uppercase + string.digits


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
