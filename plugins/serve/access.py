"""``nxdplug serve``'s options for a server on a network, with vLLM's names: API keys, TLS,
CORS, a proxy's root path, and the largest request body taken.

Open by default are only what a server on loopback needs: no key (``--api-key`` or
``NXDPLUG_API_KEY``/``VLLM_API_KEY`` sets one), no TLS, no CORS (a browser page of another
origin cannot call it); bodies are limited to :data:`DEFAULT_BODY_LIMIT`.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from typing import Any

from nxdplug.plugin_api import NxdPlugError, positive_int

# Beyond a prompt of a long-context model (128k tokens are ~0.5 MB of text), and short enough
# that parsing a body (C code that holds the interpreter's lock while it runs: ~0.3 s for 2 MB
# of chat messages here) cannot stall the other clients' streams for long. TGI's default is
# the same size.
DEFAULT_BODY_LIMIT = 2 * 1024 * 1024
API_KEY_VARIABLES = ("NXDPLUG_API_KEY", "VLLM_API_KEY")
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _names(text: str) -> list[str]:
    """An argparse type: vLLM's JSON list (``'["https://a.example"]'``) or one name."""
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings: {exc}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings; got {text!r}")
        return names
    return [text]


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("access (a server on a network)")
    group.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require Authorization: Bearer KEY on every route but /health and /metrics "
        f"(repeatable; default: {' or '.join(API_KEY_VARIABLES)} from the environment, else "
        "none)",
    )
    group.add_argument(
        "--max-request-body-size",
        type=positive_int,
        default=DEFAULT_BODY_LIMIT,
        metavar="BYTES",
        help="answer 413 to a larger request body, before it is read "
        f"(default {DEFAULT_BODY_LIMIT})",
    )
    group.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key")
    group.add_argument("--ssl-certfile", metavar="FILE", help="... and this certificate chain")
    group.add_argument(
        "--ssl-ca-certs", metavar="FILE", help="CA certificates to check client certificates"
    )
    group.add_argument(
        "--ssl-cert-reqs",
        choices=tuple(CERT_REQS),
        default="none",
        help="whether clients must show a certificate the CA certificates sign",
    )
    for flag, what in (
        ("--allowed-origins", "origins (CORS; default: none, no browser page may call)"),
        ("--allowed-methods", "methods of CORS requests (default: GET POST)"),
        ("--allowed-headers", "headers of CORS requests (default: Authorization Content-Type)"),
    ):
        group.add_argument(
            flag, action="extend", type=_names, metavar="NAMES", help=f"{what}; a JSON list or "
            "one name, repeatable"
        )  # fmt: skip
    group.add_argument(
        "--allow-credentials", action="store_true", help="let CORS requests carry credentials"
    )
    group.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a proxy serves this server under (ASGI root_path)",
    )


def api_keys(args: argparse.Namespace) -> list[str]:
    keys = args.api_key or [os.environ[v] for v in API_KEY_VARIABLES if os.environ.get(v)][:1]
    if any(not key.strip() for key in keys):
        raise NxdPlugError("--api-key: a key cannot be empty")
    return keys


def cors_policy(args: argparse.Namespace) -> Any:
    from nxdplug.plugins.serve.guards import CorsPolicy

    if not args.allowed_origins:
        for flag in ("allowed_methods", "allowed_headers", "allow_credentials"):
            if getattr(args, flag):
                raise NxdPlugError(
                    f"--{flag.replace('_', '-')} shapes CORS, which is off without "
                    "--allowed-origins: give the origins too"
                )
        return None
    settings: dict[str, Any] = {"origins": tuple(args.allowed_origins)}
    if args.allowed_methods:
        settings["methods"] = tuple(args.allowed_methods)
    if args.allowed_headers:
        settings["headers"] = tuple(args.allowed_headers)
    return CorsPolicy(**settings, credentials=args.allow_credentials)


def tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings, checked now (a key that does not match its certificate, a file
    that is missing) so that a mistake fails before the model loads."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != "none":
            raise NxdPlugError(
                "--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile"
            )
        return {}
    if args.ssl_keyfile is None or args.ssl_certfile is None:
        raise NxdPlugError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise NxdPlugError(
            f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}"
            f"{'' if args.ssl_ca_certs is None else f' / --ssl-ca-certs {args.ssl_ca_certs}'}: "
            f"cannot be loaded: {exc}"
        ) from None
    return {
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": CERT_REQS[args.ssl_cert_reqs],
    }
