"""The `minigrid` command line.

    minigrid generate --tenant alice --prompt "ALICE card QZ7K2M9P; ALICE card QZ7K2M9P; "
    minigrid pool --pool-memory 8MiB --page-size 64

Bad values get one line naming the value and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

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


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument said in one line: the usage block is what --help is for."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def _progress(json_out: bool = False) -> bool:
    """A progress bar only for a person watching: not with --json, not into a log or a pipe."""
    return not json_out and sys.stderr.isatty()


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


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} seconds: give a number above 0, e.g. 10")
    return value


def workers_per_role(text: str) -> int:
    value = positive_int(text)
    if value > 8:
        raise argparse.ArgumentTypeError(f"{value} workers: at most 8 per role")
    return value


def _pool_config(args: argparse.Namespace, default_tokens: int):  # -> PoolConfig
    from minigrid_engine.config import check_pool_size
    from minigrid_engine.model import ModelConfig
    from minigrid_engine.pool import PoolConfig

    tokens = None if args.pool_memory is not None else args.pool_tokens or default_tokens
    check_pool_size(tokens, args.page_size, "--pool-tokens", "--page-size")
    if tokens is None:
        return PoolConfig.from_memory_budget(args.pool_memory, args.page_size, ModelConfig())
    return PoolConfig(tokens, args.page_size)


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--pool-tokens", type=positive_int, help="KV pool size in tokens")
    size.add_argument("--pool-memory", type=parse_bytes, help="KV pool size as a memory budget (e.g. 8MiB)")
    p.add_argument("--page-size", type=positive_int, default=128, help="tokens per page (128)")


def cmd_pool(args: argparse.Namespace) -> int:
    from minigrid_engine.model import ModelConfig

    cfg, model = _pool_config(args, 2048), ModelConfig()
    info = {  # computed: describing a pool allocates none
        "capacity_tokens": cfg.capacity_tokens,
        "page_size": cfg.page_size,
        "pages": cfg.n_pages,
        "bytes_per_token": model.kv_bytes_per_token(),
        "bytes": cfg.nbytes(model),
    }
    print(json.dumps(info) if args.json else cfg.describe(model))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from minigrid_engine.engine import Engine
    from minigrid_engine.request import Outcome, check_seed, check_temperature
    from minigrid_engine.tokenizer import ByteTokenizer

    # Arguments as the bytes given (argv keeps invalid UTF-8 as surrogates): the tokenizer names them
    prompt = None if args.prompt is None else os.fsencode(args.prompt)
    if args.prompt_file is not None:
        prompt = args.prompt_file.read()
    if prompt is None:
        raise MinigridError("give a prompt with --prompt TEXT or --prompt-file PATH")
    tok = ByteTokenizer()
    ids = tok.encode(prompt)  # bad prompts, stops and sampling fail before the model loads
    stops = [tok.decode(tok.encode(os.fsencode(s), "a stop sequence")) for s in args.stop or ()]
    for check, flag, value in (
        (check_temperature, "--temperature", args.temperature),
        (check_seed, "--seed", args.seed),
    ):
        try:
            check(value)
        except MinigridError as exc:  # said as the API says it: name the flag too
            raise MinigridError(f"{flag} {value}: {exc}") from None
    pool = _pool_config(args, max(2 * args.context_length, args.page_size))  # two contexts, a page at least
    engine = Engine(pool=pool, context_length=args.context_length, attention=args.attention)
    print(engine.pool.describe(), file=sys.stderr)
    req = engine.submit(args.tenant, ids, args.max_tokens, args.temperature, args.seed, stops)
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

    if args.config is not None:  # the settings as JSON (Engine.start passes its config so)
        if args.preset is not None:
            raise MinigridError(f"--config {args.config} and --preset {args.preset}: choose one")
        base = _config_file(args.config)
    else:
        base = corrected_preset() if args.preset == "corrected" else incident_preset()
    changes: dict[str, object] = {}
    for flag in (
        "host",
        "port",
        "device",
        "attention",
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
        "worker_restarts",
        "worker_restart_window_s",
    ):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag)
    # Every fix is on unless asked otherwise (DESIGN.md); on the incident numbers that means
    # capacity-check refuses to start, which is the point: `--fixes none` reproduces the incident.
    # A workshop room starts with the fixes off: the lesson is the leak (the instructor switches
    # them on live, POST /v1/minigrid/fixes).
    if args.fixes is not None:
        changes["fixes"] = parse_fixes(args.fixes)
    elif args.workshop is not None:
        changes["fixes"] = parse_fixes("none")
    elif args.config is None:  # a config file says its own fixes
        changes["fixes"] = parse_fixes("all")
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
        # refused here, before anything starts, unless allowed; @TENANT must name a tenant
        parse_faults(args.inject, tenants=changes.get("tenants", base.tenants))  # type: ignore[arg-type]
        changes["inject"] = tuple(args.inject)
    if args.ready_file is not None:
        _check_writable(args.ready_file, "--ready-file")
    on_listening = None
    if args.workshop is not None:
        on_listening = _workshop(args, changes)
    elif args.keys_file is not None or args.overwrite_keys or args.public_url is not None:
        raise MinigridError("--keys-file, --overwrite-keys and --public-url go with --workshop N")
    cfg = base.with_(**changes)
    return serve(cfg, args.ready_file, on_listening, authkey)


def _config_file(path: Path):  # -> ServeConfig
    from minigrid_engine.config import ServeConfig
    from minigrid_engine.errors import ConfigError

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    try:
        return ServeConfig.from_json(text)
    except ConfigError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None


def _check_writable(path: Path, flag: str) -> None:
    """Refuse, before anything starts, a file the server could not write once it serves."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise MinigridError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise MinigridError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise MinigridError(f"{flag} {path}: the folder {folder} is not writable")


def _workshop(args: argparse.Namespace, changes: dict[str, object]):  # -> Callable[[str], list[str]]
    """Workshop mode: the room's keys (checked before anything starts), written once it listens."""
    from minigrid_engine.workshop import check_keys_file, dialable_host, make_room, write_keys

    if args.tenants is not None or args.admin_key is not None:
        raise MinigridError(
            "--workshop N makes the students' and the instructor's keys: drop --tenants/--admin-key"
        )
    if args.public_url is not None and not args.public_url.startswith(("http://", "https://")):
        raise MinigridError(f"--public-url {args.public_url!r} must start with http:// or https://")
    keys_file: Path = args.keys_file or Path("workshop-keys.csv")
    _check_writable(keys_file, "--keys-file")
    check_keys_file(keys_file, args.overwrite_keys)
    room = make_room(args.workshop)
    changes["tenants"], changes["admin_key"] = room.students, room.instructor_key

    def written(url: str) -> list[str]:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        warn = []
        if args.public_url is None and host.strip("[]") in ("0.0.0.0", "::"):
            dial = dialable_host()  # what students' machines can dial
            if dial is None:
                warn.append(
                    "workshop: WARNING: this machine has no name or address other machines can dial "
                    f"(only loopback): the keys files say localhost; give --public-url http://HOST:{port}"
                )
            url = f"http://{dial or 'localhost'}:{port}"
        shown = (args.public_url or url).rstrip("/")
        paths = write_keys(replace(room, url=shown), keys_file, args.overwrite_keys)
        return [
            f"workshop: {len(room.students)} student keys and the instructor key written to "
            f"{paths[0]} and {paths[1]} (mode 0600; the keys are not printed here)",
            f"workshop: students connect with Engine.connect({shown!r}, KEY); "
            "delete the keys files after class",
            *warn,
        ]

    return written


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

    api_key = args.api_key or os.environ.get("MINIGRID_AUDIT_API_KEY") or None
    report = audit(args.url, args.timeout, api_key=api_key, context_length=args.context_length)
    print(report.to_json() if args.json else report.text())
    return 0 if report.ok else 1


def token_counts(text: str) -> tuple[int, ...]:
    """`--prompt-tokens 1000,4000`: prompt lengths, each a whole number of tokens."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} names no length: write N,N,... (tokens)")
    return tuple(positive_int(p) for p in parts)


def cmd_probe(args: argparse.Namespace) -> int:
    from minigrid_engine.config import parse_tenants
    from minigrid_engine.probe import ProbeConfig, probe

    tenants = args.tenants or os.environ.get("MINIGRID_PROBE_TENANTS")
    if not tenants:
        raise MinigridError("give the accounts with --tenants NAME:KEY,NAME:KEY (or $MINIGRID_PROBE_TENANTS)")
    same = ("model", "context_length", "rounds", "max_tokens", "chat", "seed", "concurrency")  # flag = field
    cfg = ProbeConfig(
        url=args.url,
        tenants=parse_tenants(tenants),
        prompt_tokens=args.prompt_tokens or (),
        timeout_s=args.timeout,
        **{name: getattr(args, name) for name in same},
    )
    report = probe(cfg, progress=_progress())
    print(report.to_json() if args.json else report.text())
    if not report.ok:
        return 1
    return 0 if report.answered else 2


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
    report = fuzz(base.with_(**changes), campaign, progress=_progress(args.json))
    print(report.to_json() if args.json else report.table())
    return 0 if report.isolated else 1


def cmd_faults(args: argparse.Namespace) -> int:
    from minigrid_engine.fault_campaign import run_campaign, select

    cases = select(args.only)  # a ConfigError (exit 2) names the cases on a typo
    if args.out is not None:  # checked before a campaign of minutes, not after it
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MinigridError(f"--out {args.out}: cannot make its folder ({exc.strerror or exc})") from None
        _check_writable(args.out, "--out")
    report = run_campaign(cases, progress=_progress(args.json), restart_wait_s=args.restart_wait)
    text = report.to_json()
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text if args.json else report.table())
    return 0 if report.ok else 1


def cmd_check_protocol(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from minigrid_engine import protocol
    from minigrid_engine.fixes import parse_fixes

    names = list(protocol.SCENARIOS) if args.scenario == "all" else [args.scenario]
    bounds = {
        "requests": None if args.requests is None else protocol.parse_requests(args.requests),
        "prefill_pages": args.prefill_pages,
        "decode_pages": args.decode_pages,
        "context_pages": args.context_pages,
        "timeouts": args.timeouts,
        "losses": args.losses,
        "duplicates": args.duplicates,
        "max_states": args.max_states,
    }
    scenarios = [protocol.make_scenario(protocol.SCENARIOS[n], **bounds) for n in names]
    # one setting, or the fix table: none, each fix alone, all
    settings = {args.fixes: parse_fixes(args.fixes)} if args.fixes is not None else protocol.fix_settings()
    jobs = [(sc, name, fixes) for sc in scenarios for name, fixes in settings.items()]
    results = []
    for sc, name, fixes in tqdm(
        jobs, desc="model check", unit="run", disable=not _progress(args.json) or len(jobs) < 2
    ):
        results.append((sc, name, protocol.check_protocol(sc, fixes)))
    if args.json:
        print(json.dumps([r.to_dict() for _, _, r in results], indent=2))
    elif args.fixes is not None:
        print("\n\n".join(r.format() for _, _, r in results))
    else:
        for sc in scenarios:
            rows = [(name, r) for s, name, r in results if s is sc]
            print(protocol.format_table(sc, rows))
            shortest = next((r for name, r in rows if name == "none" and r.violation), None)
            if shortest is not None:
                print("\nthe shortest counterexample with no fix:\n" + shortest.format())
            print()
    bad = [r for _, _, r in results if not r.complete]
    if bad:
        print(
            f"minigrid check-protocol: {len(bad)} run(s) cut short at --max-states: no verdict",
            file=sys.stderr,
        )
        return 2
    if args.fixes is not None:
        return 0 if all(r.safe for _, _, r in results) else 1
    return 0 if all(r.safe for _, name, r in results if name.startswith("all")) else 1


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="minigrid", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="complete one prompt in a single process")
    g.add_argument("--tenant", default="cli", help="who the request is for; pages carry this name (cli)")
    given = g.add_mutually_exclusive_group()  # one prompt: both would leave one silently unused
    given.add_argument("--prompt", help="prompt text")
    given.add_argument(
        "--prompt-file", type=argparse.FileType("rb"), help="read the prompt (UTF-8) from a file"
    )
    g.add_argument("--max-tokens", type=positive_int, default=32, help="most tokens to generate (32)")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 picks the likeliest token (greedy); above 0 samples (0)",
    )
    g.add_argument("--seed", type=int, help="seed of the sampler when --temperature is above 0 (0)")
    g.add_argument(
        "--stop", action="append", metavar="TEXT", help="end the answer at this text, left out (repeatable)"
    )
    g.add_argument(
        "--context-length", type=positive_int, default=1024, help="longest prompt + answer, in tokens (1024)"
    )
    g.add_argument(
        "--attention", choices=["torch", "triton"], default="torch", help="paged attention backend (torch)"
    )
    _add_pool_flags(g)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start router, prefill and decode processes and serve HTTP")
    s.add_argument(
        "--preset",
        choices=["incident", "corrected"],
        help="incident (the default): context 1024 over a 665-token prefill pool; corrected: pool 2048",
    )
    s.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="start from these settings instead of a preset: JSON with the fields of "
        "minigrid_engine.config.ServeConfig (fixes: none unless the file says so); flags override them",
    )
    s.add_argument("--host", help="address the HTTP server binds (127.0.0.1)")
    s.add_argument("--port", type=int, help="HTTP port (8000; 0: any free port)")
    s.add_argument(
        "--context-length", type=positive_int, help="the advertised context, in tokens (1024 in both presets)"
    )
    s.add_argument("--page-size", type=positive_int, help="tokens per KV page (128)")
    s.add_argument(
        "--prefill-pool-tokens",
        type=positive_int,
        help="prefill KV pool, in tokens (incident 665, corrected 2048)",
    )
    s.add_argument("--decode-pool-tokens", type=positive_int, help="decode KV pool, in tokens (4096)")
    s.add_argument(
        "--fixes",
        help="none (the incident), all (the default; none with --workshop), or fix names, comma-separated",
    )
    s.add_argument("--tenants", help="NAME:KEY,NAME:KEY (default alice:sk-alice,bob:sk-bob)")
    s.add_argument("--admin-key", help="key that may read page pools and every trace (or MINIGRID_ADMIN_KEY)")
    s.add_argument("--device", choices=["cpu", "cuda"], help="where the workers compute (cpu)")
    s.add_argument("--attention", choices=["torch", "triton"], help="paged attention backend (torch)")
    s.add_argument("--max-batch", type=positive_int, help="requests decoded together in one step (32)")
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
        "NAME[=SECONDS][@TENANT] with NAME one of delay-transfer=S, delay-done=S, drop-transfer, drop-done, "
        "duplicate-transfer, duplicate-done, reorder-transfer, reorder-done, prefill-error",
    )
    s.add_argument("--ready-file", type=Path, help="write the server's URL here once it serves")
    s.add_argument(
        "--workshop",
        type=int,
        metavar="N",
        help="one shared engine for a room: N student keys (student01..) and an instructor key, "
        "written to --keys-file; fixes none unless --fixes is given",
    )
    s.add_argument(
        "--keys-file",
        type=Path,
        help="workshop keys as text/CSV for printing slips (default workshop-keys.csv), and a .json twin",
    )
    s.add_argument("--overwrite-keys", action="store_true", help="replace an existing keys file")
    s.add_argument(
        "--public-url", help="the URL students dial, written to the keys file (default: the one served)"
    )
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
    s.add_argument(
        "--worker-restarts", type=int, help="restarts of every local worker after one dies (3; 0: never)"
    )
    s.add_argument(
        "--worker-restart-window",
        dest="worker_restart_window_s",
        type=float,
        metavar="SECONDS",
        help="count --worker-restarts within any this many seconds; older restarts are forgotten (600)",
    )
    s.add_argument("--authkey-file", type=Path, help="the key workers present (64 hex digits), for --remote")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("worker", help="run a worker on this host for a router on another (serve --remote)")
    w.add_argument("--role", choices=["decode"], required=True)
    w.add_argument("--router", required=True, help="HOST:PORT the router gave as --worker-listen")
    w.add_argument("--authkey-file", type=Path, required=True, help="the router's key (64 hex digits)")
    w.add_argument("--dist-addr", help="this host's address for the KV transfer (gloo binds there)")
    w.add_argument("--index", type=int, help="which slot of the role (default: the first free one)")
    w.add_argument(
        "--connect-timeout",
        type=positive_seconds,
        default=60.0,
        help="seconds to keep trying the router (60)",
    )
    w.set_defaults(func=cmd_worker)

    au = sub.add_parser(
        "audit",
        help="check from running servers (minigrid, SGLang, vLLM) that every KV pool covers the context",
    )
    au.add_argument(
        "--url",
        required=True,
        action="append",
        help="a server's base URL, e.g. http://127.0.0.1:8000; repeat it for each server of a "
        "disaggregated deployment (its prefill and its decode servers)",
    )
    au.add_argument("--json", action="store_true", help="the verdict as JSON")
    au.add_argument(
        "--timeout", type=positive_seconds, default=10.0, help="seconds to wait for each answer (10)"
    )
    au.add_argument(
        "--api-key",
        help="sent as a Bearer token, for servers started with --api-key (default: $MINIGRID_AUDIT_API_KEY)",
    )
    au.add_argument(
        "--context-length",
        type=positive_int,
        help="the longest prompt the deployment accepts, when it is set in front of the servers "
        "(default: the largest context length the servers advertise)",
    )
    au.set_defaults(func=cmd_audit)

    pr = sub.add_parser(
        "probe",
        help="the canary test against any OpenAI-compatible deployment: exit 1 when an answer holds "
        "another account's canaries",
    )
    pr.add_argument("--url", required=True, help="the deployment's base URL, e.g. https://host/v1")
    pr.add_argument(
        "--tenants",
        help="two accounts or more, NAME:KEY,NAME:KEY (default: $MINIGRID_PROBE_TENANTS)",
    )
    pr.add_argument("--model", help="the model to ask (default: the first /v1/models lists)")
    pr.add_argument(
        "--prompt-tokens",
        type=token_counts,
        help="prompt lengths in the server's tokens, N,N,... (default: spread up to the context)",
    )
    pr.add_argument(
        "--context-length", type=positive_int, help="the context (default: /v1/models' max_model_len)"
    )
    pr.add_argument("--rounds", type=positive_int, default=3, help="prompts per account and length (3)")
    pr.add_argument("--max-tokens", type=positive_int, default=48, help="tokens per answer (48)")
    pr.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    pr.add_argument("--seed", type=int, default=0, help="seed of the canaries (0)")
    pr.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        help="prompts in flight at once, as on a busy deployment (1: one at a time, with the TTFT "
        "verdict; more: no timing verdict)",
    )
    pr.add_argument(
        "--timeout", type=positive_seconds, default=600.0, help="seconds to wait for each answer (600)"
    )
    pr.add_argument("--json", action="store_true", help="every prompt and answer as JSON")
    pr.set_defaults(func=cmd_probe)

    f = sub.add_parser(
        "fuzz",
        help="randomized multi-tenant campaign with canaries: exit 0 when isolation holds, 1 on a leak",
    )
    f.add_argument("--requests", type=positive_int, default=200, help="requests in the campaign (200)")
    f.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and hang-ups (0)")
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
    f.add_argument(
        "--context-length", type=positive_int, help="the advertised context, in tokens (the preset's)"
    )
    f.add_argument("--page-size", type=positive_int, help="tokens per KV page (the preset's)")
    f.add_argument(
        "--prefill-pool-tokens", type=positive_int, help="prefill KV pool, in tokens (the preset's)"
    )
    f.add_argument("--decode-pool-tokens", type=positive_int, help="decode KV pool, in tokens (the preset's)")
    f.add_argument("--json", action="store_true", help="the report as JSON (no progress bar)")
    f.set_defaults(func=cmd_fuzz)

    fa = sub.add_parser(
        "faults",
        help="inject each message fault and worker death into a fresh engine: exit 0 when all are survived",
        description=(
            "The fault campaign (minigrid_engine/fault_campaign.py): one small engine per fault, aimed at "
            "one tenant; checks the affected request's error, foreign data in every reply and in the trace, "
            "pages back, /health and the next request. Controls rerun faults with --fixes none and must "
            "show the harm. It starts its own engines, so no MINIGRID_FAULT_INJECTION is needed."
        ),
    )
    fa.add_argument("--only", metavar="NAME,...", help="run only these cases (see the table for the names)")
    fa.add_argument("--json", action="store_true", help="the report as JSON (no progress bar)")
    fa.add_argument(
        "--out", type=Path, help="also write the JSON report here, e.g. bench/results/faults.json"
    )
    fa.add_argument(
        "--restart-wait",
        type=positive_seconds,
        default=60.0,
        help="seconds to wait for a killed worker to come back (60)",
    )
    fa.set_defaults(func=cmd_faults)

    m = sub.add_parser(
        "check-protocol",
        help="explore every interleaving of the admission and transfer protocol: exit 0 when isolation holds",
        description="Breadth-first model check of the prefill/decode protocol (minigrid_engine/protocol.py). "
        "Without --fixes: the table of none, each fix alone and all, and the shortest counterexample. "
        "One unit is one page.",
    )
    m.add_argument(
        "--scenario",
        choices=["incident", "late-transfer", "combined", "all"],
        default="incident",
        help="incident: a prompt longer than the prefill pool; late-transfer: a transfer lands after decode "
        "gave up on it; combined: the incident with timeouts, a loss and a duplicate (incident)",
    )
    m.add_argument("--fixes", help="check one setting (none, all, or fix names) and print its trace")
    m.add_argument("--requests", metavar="TENANT:PAGES,...", help="the requests, e.g. alice:2,bob:3")
    m.add_argument("--prefill-pages", type=positive_int, help="pages in the prefill pool")
    m.add_argument("--decode-pages", type=positive_int, help="pages in the decode pool")
    m.add_argument("--context-pages", type=positive_int, help="the advertised context length, in pages")
    m.add_argument(
        "--timeouts",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode may give up on a transfer that is late (and it may land afterwards)",
    )
    m.add_argument("--losses", type=int, help="messages the network may lose (0-3)")
    m.add_argument("--duplicates", type=int, help="messages the network may deliver twice (0-3)")
    m.add_argument("--max-states", type=positive_int, help="stop a search after this many states (2,000,000)")
    m.add_argument("--json", action="store_true", help="the results as JSON")
    m.set_defaults(func=cmd_check_protocol)

    q = sub.add_parser("pool", help="show the size of a KV pool: tokens, pages, bytes")
    _add_pool_flags(q)
    q.add_argument("--json", action="store_true", help="the sizes as JSON")
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
    except KeyboardInterrupt as exc:  # Ctrl-C; SIGTERM while serve starts its workers (serve.Terminated)
        return 128 + int(getattr(exc, "signum", signal.SIGINT))


if __name__ == "__main__":
    sys.exit(main())
