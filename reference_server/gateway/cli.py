"""``kvclient gateway``: the reservation ledger in front of real engines (vLLM, llama.cpp, TGI,
SGLang), on one port."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvclient.cli_options import TOKENIZER_HELP, HelpFormatter, add_log_level, setup_logging

from ..admission.holders import DEFAULT_RELAY_LAG
from ..admission.ledger import DEFAULT_SAFETY_FRACTION, RULES
from ..admission.preemption import DEFAULT_START_QUANTILE, LADDER
from ..http.serving import configure, load_tokenizer, serve, serve_workers
from .config import (
    DEFAULT_DECODE_RATE,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_MAX_QUEUE_WAIT,
    DEFAULT_PREEMPTION_BUDGET,
    DEFAULT_SEND_TIMEOUT,
    GatewayConfig,
)
from .tenants import load_tenants

__all__ = ["WorkerApp", "build_parser", "config_from_args", "main"]

DEFAULT_PORT = 8080

_DESCRIPTION = """\
An OpenAI-compatible front (/v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/health, /metrics) that admits each request against a KV reservation ledger (prompt + output
cap) and forwards it to an upstream engine with its max_tokens made explicit, so the engine can
never run past what was reserved. Out of budget: 429 with Retry-After.

Each upstream's context window and KV budget are discovered from its own endpoints (vLLM
/metrics cache_config_info, llama.cpp /props, TGI /metrics, SGLang /get_server_info), or given
with --kv-tokens, once per --upstream, in the same order.

Two admission rules. caps: the sum of every holder's whole reservation must fit, which holds
whatever the engine does. peak (the default where the engine qualifies): the most the holders
can ever hold at once, from the tokens each has generated so far, must fit, which is exact while
the engine runs every admitted sequence at each step (no more than --max-running, none waiting
inside it, no preemption; else that upstream counts whole caps until its holders have gone).
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvclient gateway",
        description=_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--upstream", action="append", required=True, metavar="URL",
        help="an engine's base URL, e.g. http://127.0.0.1:8000 (repeat for several)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-tokens", action="append", type=int, default=[], metavar="TOKENS",
        help="the KV budget of the upstream at the same position (default: discovered)",
    )  # fmt: skip
    parser.add_argument(
        "--max-running", action="append", type=int, default=[], metavar="N",
        help="how many sequences the upstream at the same position runs at once (vLLM's "
        "--max-num-seqs; default: discovered where the engine says, else that upstream "
        "counts whole caps)",
    )  # fmt: skip
    add = parser.add_argument
    add(
        "--admission-rule", choices=RULES, default="peak",
        help="peak: admit by the most the holders can hold at once from their progress, where "
        "the engine qualifies; caps: by the sum of their whole reservations (default: "
        "%(default)s)",
    )  # fmt: skip
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s; 0: any)")
    add(
        "--context-window", type=int, metavar="TOKENS",
        help="the context window of every upstream (default: discovered per upstream)",
    )  # fmt: skip
    add(
        "--safety-fraction", type=float, metavar="F",
        help="share of each upstream's KV pool that is admitted (default: the pool less what the "
        f"engine keeps for itself where it counts its pool in blocks, vLLM's; else "
        f"{DEFAULT_SAFETY_FRACTION})",
    )  # fmt: skip
    add(
        "--preemption-budget", action="append", type=float, default=[], metavar="N",
        help="preemptions per 1,000 requests the upstream at the same position may pay for "
        "holders counted by a forecast of their outputs (learnt from finished ones) instead of "
        "their caps; its quantile tightens when the engine's own counter runs over N; 0: the "
        "exact rule (default: "
        f"{DEFAULT_PREEMPTION_BUDGET:g} for an engine whose overflow preempts and recomputes, "
        "vLLM's and SGLang's; 0, always, for one whose overflow fails requests)",
    )  # fmt: skip
    add(
        "--forecast-quantile", type=float, default=DEFAULT_START_QUANTILE, metavar="Q",
        help="the quantile of a holder's remaining output the forecast starts at, before the "
        f"preemption budget moves it ({', '.join(f'{q:g}' for q in LADDER)}; default: "
        "%(default)s)",
    )  # fmt: skip
    add(
        "--max-queue-wait", type=float, default=DEFAULT_MAX_QUEUE_WAIT, metavar="S",
        help="a request that does not fit waits up to S seconds in FIFO order (in fair order "
        "with --tenants) for budget before "
        "a 429, admitted the moment a release makes room; a client's 'Prefer: wait=N' "
        "shortens it; 0 refuses at once (default: %(default)s)",
    )  # fmt: skip
    add(
        "--tenants", type=Path, metavar="FILE",
        help="share each upstream's KV budget fairly between tenants, by the weights, limits, "
        "queue waits and priority classes in this TOML file, each tenant known by the API keys "
        "it lists (see the gateway guide); X-Priority is served within the classes a tenant is "
        "granted (default: one FIFO queue for everyone, X-Priority ignored)",
    )  # fmt: skip
    add(
        "--tenant-header", metavar="NAME",
        help="with --tenants: the header naming the tenant of a request no listed key names; "
        "set by your proxy; never pass the client's (default: not read)",
    )  # fmt: skip
    add(
        "--decode-rate", type=float, default=DEFAULT_DECODE_RATE, metavar="TOKENS_PER_S",
        help="per-sequence decode rate assumed for Retry-After estimates until one is measured "
        "(default: %(default)s)",
    )  # fmt: skip
    add(
        "--relay-lag", type=float, default=DEFAULT_RELAY_LAG, metavar="S",
        help="peak rule: the longest a token takes from the engine's decode step to the gateway; "
        "each holder is taken to have made what it can decode in S seconds more than relayed "
        "(default: %(default)s)",
    )  # fmt: skip
    add(
        "--send-timeout", type=float, default=DEFAULT_SEND_TIMEOUT, metavar="S",
        help="end a request when a write of its answer waits S seconds for the client to read "
        "(a client that stopped reading), releasing its reservation (default: %(default)s)",
    )  # fmt: skip
    add(
        "--tokenizer", type=Path, metavar="PATH",
        help=f"{TOKENIZER_HELP}; counts instead of the upstream's /tokenize "
        "(default: the upstream's)",
    )  # fmt: skip
    add(
        "--api-key", default=os.environ.get("KVCLIENT_GATEWAY_API_KEY"), metavar="KEY",
        help="require 'Authorization: Bearer KEY' from clients, except on /health and /metrics "
        "(default: $KVCLIENT_GATEWAY_API_KEY); checked here, never sent upstream",
    )  # fmt: skip
    add(
        "--upstream-api-key", default=os.environ.get("KVCLIENT_UPSTREAM_API_KEY"), metavar="KEY",
        help="send 'Authorization: Bearer KEY' to every upstream "
        "(default: $KVCLIENT_UPSTREAM_API_KEY); a user and password in an upstream's URL are "
        "sent to it as Basic auth instead",
    )  # fmt: skip
    add(
        "--upstream-ca-bundle", metavar="PEM",
        help="verify https upstreams with these CA certificates (default: the system's)",
    )  # fmt: skip
    add(
        "--upstream-client-cert", metavar="PEM",
        help="a client certificate for https upstreams, with its key or --upstream-client-key "
        "(default: none)",
    )  # fmt: skip
    add(
        "--upstream-client-key",
        metavar="PEM",
        help="the key of --upstream-client-cert (default: in the certificate's file)",
    )
    add(
        "--ledger", default=os.environ.get("KVCLIENT_GATEWAY_LEDGER"), metavar="URL",
        help="keep every upstream's reservations in Redis (redis://HOST:PORT/DB, rediss:// for "
        "TLS, redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB] for the master a Sentinel "
        "names SERVICE, followed through a failover; a password in the URL or in "
        "$KVCLIENT_LEDGER_PASSWORD), shared by every gateway "
        "given the same URL (default: $KVCLIENT_GATEWAY_LEDGER, else in this process only). "
        "While Redis is away new requests get 503 with Retry-After; admitted ones finish. "
        "Not supported: Redis Cluster, and TLS to Sentinel",
    )  # fmt: skip
    add(
        "--ledger-ca-file", metavar="PEM",
        help="with a rediss:// --ledger: verify Redis's certificate with these CA certificates, "
        "e.g. a self-signed CA (default: the system's)",
    )  # fmt: skip
    add(
        "--ledger-client-cert", metavar="PEM",
        help="with a rediss:// --ledger: a client certificate for a Redis that asks for one "
        "(tls-auth-clients), with its key or --ledger-client-key (default: none)",
    )  # fmt: skip
    add(
        "--ledger-client-key", metavar="PEM",
        help="the key of --ledger-client-cert (default: in the certificate's file)",
    )  # fmt: skip
    add(
        "--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS, metavar="S",
        help="with --ledger: a gateway that dies loses its reservations after S seconds, one "
        "whose event loop is stuck after 3 S at most (default: %(default)s)",
    )  # fmt: skip
    add(
        "--workers", type=int, default=1, metavar="N",
        help="serve N processes on one port (needs --ledger when N > 1: they share its budget), "
        "supervised by uvicorn: a worker that dies is replaced, SIGHUP replaces them one by one",
    )  # fmt: skip
    add(
        "--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
        help="the event loop: auto is uvloop when it is installed (pip install "
        "'kvclient[gateway]'), else asyncio (default: %(default)s)",
    )  # fmt: skip
    add_log_level(parser, default="info")
    return parser


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.workers > 1 and not args.ledger:
        raise ValueError(
            "--workers N > 1 needs --ledger redis://...: without a shared ledger each process "
            "would admit against every upstream's whole budget, N times what it holds"
        )
    counter = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    tenants = load_tenants(args.tenants) if args.tenants is not None else None
    return GatewayConfig(
        upstreams=tuple(args.upstream),
        kv_tokens=tuple(args.kv_tokens),
        max_running=tuple(args.max_running),
        preemption_budget=tuple(args.preemption_budget),
        forecast_quantile=args.forecast_quantile,
        admission_rule=args.admission_rule,
        context_window=args.context_window,
        safety_fraction=args.safety_fraction,
        max_queue_wait=args.max_queue_wait,
        fairness=tenants.policy if tenants is not None else None,
        tenant_keys=tenants.keys if tenants is not None else None,
        tenant_header=args.tenant_header,
        decode_rate=args.decode_rate,
        relay_lag=args.relay_lag,
        send_timeout=args.send_timeout,
        counter=counter,
        api_key=args.api_key,
        upstream_api_key=args.upstream_api_key,
        upstream_ca_bundle=args.upstream_ca_bundle,
        upstream_client_cert=args.upstream_client_cert,
        upstream_client_key=args.upstream_client_key,
        ledger=args.ledger,
        lease_seconds=args.lease_seconds,
        ledger_ca_file=args.ledger_ca_file,
        ledger_client_cert=args.ledger_client_cert,
        ledger_client_key=args.ledger_client_key,
    )


@dataclass(frozen=True, slots=True)
class WorkerApp:
    """The gateway's app, built in a worker process of ``--workers N`` from the command line:
    picklable, as uvicorn's supervisor starts each worker as a fresh interpreter (and starts a
    new one when a worker dies)."""

    argv: tuple[str, ...]

    def __call__(self) -> Any:
        from .app import create_gateway_app

        args, config = configure(build_parser(), self.argv, config_from_args)
        setup_logging(args.log_level)
        return create_gateway_app(config)


def main(argv: Sequence[str] | None = None) -> int:
    args, config = configure(build_parser(), argv, config_from_args)
    from .app import create_gateway_app
    from .config import public_url

    setup_logging(args.log_level)
    names = ", ".join(public_url(url) for url in config.upstreams)
    print(
        f"kvclient gateway in front of {names} (discovered on the first request)", file=sys.stderr
    )
    if args.workers > 1:
        return serve_workers(
            WorkerApp(tuple(sys.argv[1:] if argv is None else argv)),
            workers=args.workers,
            host=args.host,
            port=args.port,
            what="kvclient gateway",
            loop=args.loop,
            log_level=args.log_level,
        )
    return serve(
        create_gateway_app(config),
        host=args.host,
        port=args.port,
        what="kvclient gateway",
        loop=args.loop,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    sys.exit(main())
