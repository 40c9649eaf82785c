"""The `minigrid` command line.

    minigrid generate --tenant alice --prompt "ALICE card QZ7K2M9P; ALICE card QZ7K2M9P; "
    minigrid pool --pool-memory 8MiB --page-size 64

Bad values get one line naming the value and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from minigrid_engine.errors import MinigridError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'8MiB' -> 8388608; '1.5GB' -> 1500000000. Raises argparse's error type on nonsense."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size: use bytes or a unit such as 512KiB, 8MiB, 2GB"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"memory size {text!r} must be positive")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def workers_per_role(text: str) -> int:
    value = positive_int(text)
    if value > 8:
        raise argparse.ArgumentTypeError(f"{value} workers: at most 8 per role")
    return value


def _pool_config(args: argparse.Namespace, default_tokens: int):  # -> PoolConfig
    from minigrid_engine.model import ModelConfig
    from minigrid_engine.pool import PoolConfig

    if args.pool_memory is not None:
        return PoolConfig.from_memory_budget(args.pool_memory, args.page_size, ModelConfig())
    return PoolConfig(args.pool_tokens or default_tokens, args.page_size)


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--pool-tokens", type=positive_int, help="KV pool size in tokens")
    size.add_argument("--pool-memory", type=parse_bytes, help="KV pool size as a memory budget (e.g. 8MiB)")
    p.add_argument("--page-size", type=positive_int, default=128, help="tokens per page (128)")


def cmd_pool(args: argparse.Namespace) -> int:
    from minigrid_engine.model import ModelConfig
    from minigrid_engine.pool import KVPool

    cfg = _pool_config(args, 2048)
    pool = KVPool(cfg, ModelConfig(), "engine")
    info = {
        "capacity_tokens": cfg.capacity_tokens,
        "page_size": cfg.page_size,
        "pages": cfg.n_pages,
        "bytes_per_token": ModelConfig().kv_bytes_per_token(),
        "bytes": pool.bytes,
    }
    print(json.dumps(info) if args.json else pool.describe())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from minigrid_engine.engine import Engine
    from minigrid_engine.request import Outcome
    from minigrid_engine.tokenizer import ByteTokenizer

    prompt = args.prompt
    if args.prompt_file is not None:
        prompt = args.prompt_file.read()  # bytes: the tokenizer names any invalid UTF-8
    if prompt is None:
        raise MinigridError("give a prompt with --prompt TEXT or --prompt-file PATH")
    ids = ByteTokenizer().encode(prompt)  # bad prompts fail before the model loads
    pool = _pool_config(args, 2 * args.context_length)
    engine = Engine(pool=pool, context_length=args.context_length, attention=args.attention)
    print(engine.pool.describe(), file=sys.stderr)
    req = engine.submit(args.tenant, ids, args.max_tokens, args.temperature)
    engine.run()
    if req.outcome is Outcome.REJECTED:
        print(f"minigrid generate: rejected: {req.error}", file=sys.stderr)
        return 1
    print(engine.tokenizer.decode(req.output_ids))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from minigrid_engine.config import corrected_preset, incident_preset, parse_tenants
    from minigrid_engine.faults import parse_faults
    from minigrid_engine.fixes import parse_fixes
    from minigrid_engine.serve import serve

    base = corrected_preset() if args.preset == "corrected" else incident_preset()
    changes: dict[str, object] = {
        "host": args.host,
        "port": args.port,
        "device": args.device,
        "attention": args.attention,
    }
    for flag in (
        "context_length",
        "page_size",
        "prefill_pool_tokens",
        "decode_pool_tokens",
        "max_batch",
        "admin_key",
        "release_timeout_s",
        "prefill_workers",
        "decode_workers",
        "transfer_host",
        "worker_listen",
    ):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    # Every fix is on unless asked otherwise (DESIGN.md); on the incident numbers that means
    # capacity-check refuses to start, which is the point: `--fixes none` reproduces the incident.
    changes["fixes"] = parse_fixes(args.fixes if args.fixes is not None else "all")
    if args.tenants is not None:
        changes["tenants"] = parse_tenants(args.tenants)
    authkey = None
    if args.remote:
        changes["remote"] = tuple(args.remote)
        if args.authkey_file is None:
            raise MinigridError(
                f"--remote {' '.join(args.remote)}: give --authkey-file FILE (64 hex digits, e.g. from "
                "`openssl rand -hex 32`), the key the remote worker presents"
            )
        if "worker_listen" not in changes:
            raise MinigridError(
                f"--remote {' '.join(args.remote)}: give --worker-listen HOST:PORT, an address of this "
                "host the remote worker can reach"
            )
    if args.authkey_file is not None:
        authkey = _authkey(args.authkey_file)
    if args.inject:
        parse_faults(args.inject)  # refused here, before anything starts, unless allowed
        changes["inject"] = tuple(args.inject)
    cfg = base.with_(**changes)
    return serve(cfg, args.ready_file, authkey)


def _authkey(path: Path) -> bytes:
    from minigrid_engine.errors import ConfigError

    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--authkey-file {path}: {exc.strerror}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(
            f"--authkey-file {path}: the file must hold hex digits (openssl rand -hex 32)"
        ) from None
    if len(key) < 16:
        raise ConfigError(
            f"--authkey-file {path}: the key is {len(key)} bytes; use at least 16 (openssl rand -hex 32)"
        )
    return key


def cmd_worker(args: argparse.Namespace) -> int:
    from minigrid_engine.worker import remote_main

    return remote_main(
        args.role, args.router, _authkey(args.authkey_file), args.dist_addr, args.index, args.connect_timeout
    )


def cmd_audit(args: argparse.Namespace) -> int:
    from minigrid_engine.audit import audit

    report = audit(args.url, args.timeout)
    print(report.to_json() if args.json else report.text())
    return 0 if report.ok else 1


def cmd_fuzz(args: argparse.Namespace) -> int:
    from minigrid_engine.config import corrected_preset, incident_preset
    from minigrid_engine.fixes import parse_fixes
    from minigrid_engine.fuzz import FuzzConfig, fuzz

    fixes = parse_fixes(args.fixes)
    preset = args.preset
    if preset == "auto":  # capacity-check refuses the incident's numbers: fuzz the corrected pool
        preset = "corrected" if fixes.capacity_check else "incident"
    base = corrected_preset() if preset == "corrected" else incident_preset()
    changes: dict[str, object] = {"fixes": fixes}
    for flag in ("context_length", "page_size", "prefill_pool_tokens", "decode_pool_tokens"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    campaign = FuzzConfig(
        requests=args.requests,
        seed=args.seed,
        tenants=args.tenants,
        concurrency=args.concurrency,
        abort_rate=args.abort_rate,
        max_tokens=args.max_tokens,
    )
    report = fuzz(base.with_(**changes), campaign, progress=not args.json)
    print(report.to_json() if args.json else report.table())
    return 0 if report.isolated else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minigrid", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="complete one prompt in a single process")
    g.add_argument("--tenant", default="cli")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-file", type=argparse.FileType("rb"), help="read the prompt (UTF-8) from a file")
    g.add_argument("--max-tokens", type=positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--context-length", type=positive_int, default=1024)
    g.add_argument(
        "--attention", choices=["torch", "triton"], default="torch", help="paged attention backend (torch)"
    )
    _add_pool_flags(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start router, prefill and decode processes and serve HTTP")
    s.add_argument(
        "--preset",
        choices=["incident", "corrected"],
        default="incident",
        help="incident: context 1024 over a 665-token prefill pool; corrected: pool 2048",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--context-length", type=positive_int)
    s.add_argument("--page-size", type=positive_int)
    s.add_argument("--prefill-pool-tokens", type=positive_int)
    s.add_argument("--decode-pool-tokens", type=positive_int)
    s.add_argument(
        "--fixes", help="none (the incident), all (default), or a comma-separated list of fix names"
    )
    s.add_argument("--tenants", help="NAME:KEY,NAME:KEY (default alice:sk-alice,bob:sk-bob)")
    s.add_argument("--admin-key", help="key that may read page pools and every trace (or MINIGRID_ADMIN_KEY)")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    s.add_argument("--attention", choices=["torch", "triton"], default="torch")
    s.add_argument("--max-batch", type=positive_int)
    s.add_argument(
        "--release-timeout",
        dest="release_timeout_s",
        type=float,
        help="seconds decode waits for a transfer before giving up (5)",
    )
    s.add_argument(
        "--inject",
        action="append",
        metavar="FAULT",
        help="fault injection for tests and labs (needs MINIGRID_FAULT_INJECTION=1): "
        "delay-transfer=SECONDS, drop-done, duplicate-done",
    )
    s.add_argument("--ready-file", type=Path, help="write the server's URL here once it serves")
    s.add_argument("--prefill-workers", type=workers_per_role, help="prefill worker processes, 1 to 8 (1)")
    s.add_argument("--decode-workers", type=workers_per_role, help="decode worker processes, 1 to 8 (1)")
    s.add_argument(
        "--remote",
        action="append",
        choices=["decode"],
        help="this role's workers run on another host and join with `minigrid worker`",
    )
    s.add_argument(
        "--transfer-host", help="this host's address for the KV transfer (prefill's listeners), 127.0.0.1"
    )
    s.add_argument("--worker-listen", help="HOST:PORT where the router waits for its workers")
    s.add_argument("--authkey-file", type=Path, help="the key workers present (64 hex digits), for --remote")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("worker", help="run a worker on this host for a router on another (serve --remote)")
    w.add_argument("--role", choices=["decode"], required=True)
    w.add_argument("--router", required=True, help="HOST:PORT the router gave as --worker-listen")
    w.add_argument("--authkey-file", type=Path, required=True, help="the router's key (64 hex digits)")
    w.add_argument("--dist-addr", help="this host's address for the KV transfer (gloo binds there)")
    w.add_argument("--index", type=int, help="which slot of the role (default: the first free one)")
    w.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to keep trying the router (60)"
    )
    w.set_defaults(func=cmd_worker)

    au = sub.add_parser(
        "audit", help="check from a running engine's /metrics that its pools cover the context"
    )
    au.add_argument("--url", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    au.add_argument("--json", action="store_true")
    au.add_argument("--timeout", type=float, default=10.0)
    au.set_defaults(func=cmd_audit)

    f = sub.add_parser(
        "fuzz",
        help="randomized multi-tenant campaign with canaries: exit 0 when isolation holds, 1 on a leak",
    )
    f.add_argument("--requests", type=positive_int, default=200)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--fixes", default="all", help="none (the incident), all (default), or fix names")
    f.add_argument("--tenants", type=positive_int, default=3, help="how many tenants (3)")
    f.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight at once (8)")
    f.add_argument("--abort-rate", type=float, default=0.1, help="share of clients that hang up (0.1)")
    f.add_argument("--max-tokens", type=positive_int, default=32, help="most tokens a request asks for (32)")
    f.add_argument(
        "--preset",
        choices=["auto", "incident", "corrected"],
        default="auto",
        help="auto: corrected when capacity-check is on (it refuses the incident's numbers), else incident",
    )
    f.add_argument("--context-length", type=positive_int)
    f.add_argument("--page-size", type=positive_int)
    f.add_argument("--prefill-pool-tokens", type=positive_int)
    f.add_argument("--decode-pool-tokens", type=positive_int)
    f.add_argument("--json", action="store_true", help="the report as JSON (no progress bar)")
    f.set_defaults(func=cmd_fuzz)

    q = sub.add_parser("pool", help="show the size of a KV pool: tokens, pages, bytes")
    _add_pool_flags(q)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_pool)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except MinigridError as exc:
        print(f"minigrid {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"minigrid {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
