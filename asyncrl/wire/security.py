"""Socket security: per-socket message-size limits and ZeroMQ CURVE, for every socket of a run.

A process calls ``configure(cfg.security)`` once, before it opens sockets (``ProcessContext`` and
the controller do); ``asyncrl.wire.sockets`` and the weight stream then ask this module for the size
limit of each kind of receiving socket and call ``secure(sock, address, bind)`` before each bind
or connect. The settings are per process because every socket of a process belongs to one run.

Size limits (``max_message_bytes``): ZeroMQ's ``MAXMSGSIZE`` on every receiving socket, so libzmq
refuses a frame larger than the limit from its length header, before buffering it. libzmq does
that by closing the connection (the frame and anything behind it on that connection are lost;
a ZeroMQ peer reconnects by itself after ``RECONNECT_IVL``, 100 ms). The limit is per frame:
the weight stream's multipart buckets pass as long as each ~1 MiB frame does.

CURVE (``curve: true``): the binding side of a socket is the CURVE server with the run's server
key pair, and a ZAP authenticator (one thread per process) admits only clients whose public key
is in ``KEYS_DIR/authorized/``; the connecting side uses a client key pair and the server's
public key. ``asyncrl keys KEYS_DIR`` writes them (``write_keys``)::

    KEYS_DIR/server.key          server public key (every client needs it)
    KEYS_DIR/server.key_secret   server secret key (mode 0600; processes that bind)
    KEYS_DIR/client.key[_secret] a client key pair (mode 0600; processes that connect)
    KEYS_DIR/authorized/*.key    public keys the servers admit

A client without a key, with a key not in ``authorized/``, or with a wrong server key fails the
handshake: nothing it sends is delivered, and the server counts it in
``asyncrl_auth_failures_total{socket}`` (``asyncrl.wire.socketwatch``). Keys are referenced by path
only: the config (and so ``config.yaml``) holds the directory, never key material, and nothing
here logs a key.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth
from pydantic import Field

from asyncrl.configbase import Config

log = logging.getLogger(__name__)

MiB = 1 << 20
ZAP_DOMAIN = "asyncrl"  # the authenticator's keys apply to this domain, which every server names


class MessageLimits(Config):
    """Largest frame, in bytes, each kind of receiving socket accepts (``MAXMSGSIZE``)."""

    stream: int = Field(64 * MiB, ge=1024)
    """PULL (reward and buffer inputs, events, acks): one group or event per frame; a group of 16
    answers of 32k tokens is ~8 MiB."""
    request: int = Field(64 * MiB, ge=1024)
    """ROUTER (dispatcher, buffer requests, reward share, reference): requests, the largest being
    reference-logprob requests ((B, L) ids and mask)."""
    reply: int = Field(1024 * MiB, ge=1024)
    """DEALER (learner, generators, hot-plugged reward workers): replies, the largest being a
    training batch (batch_groups x n x T x ~12 bytes)."""
    subscribe: int = Field(64 * MiB, ge=1024)
    """SUB (control, buffer status, weight announcements and weight-stream frames of
    ``weights.frame_mb``)."""


class SecurityConfig(Config):
    """Message-size limits and ZeroMQ CURVE authentication and encryption of the run's sockets."""

    max_message_bytes: MessageLimits = MessageLimits()
    """Per kind of receiving socket, the largest frame accepted; a larger one is refused by
    ZeroMQ before it is buffered and counted as rejected with reason ``oversized``."""
    curve: bool = False
    """Require CURVE authentication and encryption (keys from ``asyncrl keys KEYS_DIR``)."""
    scope: Literal["all", "cross_host"] = "all"
    """With ``curve``: ``all`` sockets, or only ``cross_host`` ones (a tcp address that is not a
    loopback one; both sides decide from the same address string in ``endpoints.json``)."""
    keys_dir: str = "keys"
    """Directory written by ``asyncrl keys`` (relative to the working directory); only this path
    is stored in the config, never a key."""
    client_key: str = "client"
    """Name of the client key pair in ``keys_dir`` this process connects with."""


_settings = SecurityConfig()
_auth_lock = threading.Lock()
_authenticator = None  # zmq.auth.thread.ThreadAuthenticator, started with the first CURVE server


def configure(cfg: SecurityConfig) -> None:
    """Use ``cfg`` for every socket this process opens from now on."""
    global _settings
    if cfg.curve and not Path(cfg.keys_dir).is_dir():
        raise FileNotFoundError(
            f"security.keys_dir ({cfg.keys_dir!r}) must be a directory of keys when security.curve is true: "
            f"make one with `asyncrl keys {cfg.keys_dir}`"
        )
    _settings = cfg


def settings() -> SecurityConfig:
    return _settings


def reset() -> None:
    """Back to the defaults (no CURVE) and stop the authenticator (tests)."""
    global _settings, _authenticator
    _settings = SecurityConfig()
    with _auth_lock:
        if _authenticator is not None:
            _authenticator.stop()
            _authenticator = None


def max_message_bytes(kind: str) -> int:
    """The configured limit of one kind of receiving socket (a field of ``MessageLimits``)."""
    return getattr(_settings.max_message_bytes, kind)


def is_local(address: str) -> bool:
    """ipc/inproc, or tcp on a loopback host: traffic that never leaves this machine."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "*": may be reached from elsewhere
        return False


def uses_curve(address: str) -> bool:
    return _settings.curve and (_settings.scope == "all" or not is_local(address))


def secure(sock: zmq.Socket, address: str, bind: bool) -> bool:
    """Make ``sock`` a CURVE server (``bind``) or client when the settings ask for it; call it
    before ``bind``/``connect``. Returns whether CURVE is on."""
    if not uses_curve(address):
        return False
    keys = Path(_settings.keys_dir)
    if bind:
        public, secret = _load_pair(keys / "server.key_secret")
        _start_authenticator(keys / "authorized")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        # Fail every handshake if no ZAP handler answers, instead of admitting any key.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.zap_domain = ZAP_DOMAIN.encode()
    else:
        public, secret = _load_pair(keys / f"{_settings.client_key}.key_secret")
        server_public, _ = zmq.auth.load_certificate(_existing(keys / "server.key"))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public
    return True


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"key file {path} is missing: write the keys with `asyncrl keys {path.parent}`")
    return path


def _load_pair(secret_file: Path) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(_existing(secret_file))
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key (it must be a *.key_secret file)")
    return public, secret


def _start_authenticator(authorized: Path) -> None:
    global _authenticator
    from zmq.auth.thread import ThreadAuthenticator

    if not authorized.is_dir():
        raise FileNotFoundError(f"{authorized} (the public keys a server admits) is missing")
    with _auth_lock:
        if _authenticator is None:
            auth = ThreadAuthenticator(zmq.Context.instance())
            auth.start()
            # The allowed keys are read now: a key added later needs a restart.
            auth.configure_curve(domain=ZAP_DOMAIN, location=str(authorized))
            _authenticator = auth


def write_keys(keys_dir: str | Path, clients: list[str] = ("client",), force: bool = False) -> dict[str, Path]:
    """Write the server key pair and one pair per client name, and authorize the clients.

    Secret files are created with mode 0600 (under a 077 umask, so they are never readable by
    others, not even briefly). Refuses to replace existing keys unless ``force``: running
    processes and other hosts hold the old ones. Returns name -> public key file.
    """
    keys = Path(keys_dir)
    names = ["server", *clients]
    if len(set(names)) != len(names):
        raise ValueError(f"client names ({list(clients)}) must be distinct and not 'server'")
    existing = [keys / f"{n}.key_secret" for n in names if (keys / f"{n}.key_secret").exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists: refusing to replace keys (pass --force to replace them)")
    authorized = keys / "authorized"
    old_umask = os.umask(0o077)
    try:
        authorized.mkdir(parents=True, exist_ok=True)
        out = {}
        for name in names:
            public, secret = zmq.auth.create_certificates(keys, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)  # public keys are meant to be copied to other hosts
            out[name] = Path(public)
            if name != "server":
                shutil.copyfile(public, authorized / f"{name}.key")
                os.chmod(authorized / f"{name}.key", 0o644)
    finally:
        os.umask(old_umask)
    return out
