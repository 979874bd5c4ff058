"""``--storage-option KEY=VALUE``: options for the fsspec file systems of the URLs on a command line.

Repeatable; a value that parses as JSON is taken as JSON (``anon=true``,
``client_kwargs='{"region_name": "eu-west-1"}'``), anything else as a string. The options go
to fsspec's per-protocol configuration (``fsspec.config.conf``, the same place its
``FSSPEC_<PROTOCOL>_<KEY>`` environment variables land) for the protocols of the command's URLs,
for the duration of the command; the store's own environment (``AWS_ENDPOINT_URL``, profiles...)
applies as usual beneath them. ``unickpt_timeout=SECONDS`` is unickpt's own: the deadline of every
operation on the store (as ``UNICKPT_STORE_TIMEOUT``, which it sets for the command).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
from collections.abc import Iterator
from typing import Any

from unickpt.errors import ConfigError
from unickpt.store.storage import is_url
from unickpt.store.storage_guard import ENV, OPTION, store_timeout

__all__ = ["add_storage_option", "parse_storage_options", "storage_options_applied"]


def add_storage_option(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec option for the URLs given (repeatable; JSON values allowed), "
        "e.g. endpoint_url=http://127.0.0.1:9000 or anon=true",
    )


def parse_storage_options(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` as a dict; ``ConfigError`` naming an item without ``=`` or with an empty key."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {item!r}: expected KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out


def _protocols(args: argparse.Namespace) -> set[str]:
    found = set()
    for value in vars(args).values():
        if isinstance(value, str) and is_url(value):
            found.add(value.split("://", 1)[0])
    return found


@contextlib.contextmanager
def storage_options_applied(args: argparse.Namespace) -> Iterator[None]:
    """Apply ``args.storage_option`` to the protocols of the command's URLs while the command runs."""
    items = getattr(args, "storage_option", None) or []
    if not items:
        yield
        return
    opts = parse_storage_options(items)
    protocols = _protocols(args)
    if not protocols:
        raise ConfigError("--storage-option applies to URLs (s3://, gs://, ...), and the command names none")
    import fsspec.config

    timeout = opts.pop(OPTION, None)
    if timeout is not None:
        store_timeout(timeout)  # a ConfigError now for a value that is not seconds
    saved = copy.deepcopy(fsspec.config.conf)
    saved_env = os.environ.get(ENV)
    try:
        for proto in protocols:
            fsspec.config.conf.setdefault(proto, {}).update(opts)
        if timeout is not None:
            os.environ[ENV] = str(timeout)
        yield
    finally:
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved)
        if timeout is not None:
            if saved_env is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = saved_env
