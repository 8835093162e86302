"""The internal sockets' security: CURVE on every ZeroMQ endpoint that listens on a network, a size
limit on the frames a server receives, and a log line for every refused peer.

The launcher's endpoints are ipc:// in a private folder (or loopback tcp://), which only this
host's user can reach; the compose stack's listen on the container network, where any container
could send the kvstore an op log. There, CURVE (ZeroMQ's authentication and encryption,
Curve25519) protects them. A keys folder (`pagedserve keys DIR`, or --curve-keys / the
PAGEDSERVE_CURVE_KEYS environment variable) holds:

    server.key, server.key_secret    the listening side's keypair (kvstore, scheduler, worker)
    client.key, client.key_secret    the connecting side's keypair (scheduler, worker, router)
    authorized/*.key                 the client public keys a server accepts (the allow-list)

A server checks every connecting client's public key against authorized/ through a ZAP handler
(pyzmq's ThreadAuthenticator, one per context): a client without keys fails the handshake
(mechanism mismatch), one with a key not on the list is denied; both are logged and the server
carries on. A server asked to
listen on a non-loopback tcp:// address without keys refuses to start (InsecureEndpoint): there is
no opt-out, because making keys is one command.

Every listening socket also drops a peer that sends a frame over MAX_FRAME_BYTES (ZeroMQ's
MAXMSGSIZE: the frame is refused before it is allocated, and the connection is closed), logged as a
dropped peer; the peer's side reconnects. Connecting sockets have no limit: their peer is the
server they chose (and, with keys, authenticated), and libzmq never reconnects a connecting socket
after a protocol error such as an oversized frame, so a limit there would cut it off for good.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

KEYS_ENV = "PAGEDSERVE_CURVE_KEYS"
ZAP_DOMAIN = "pagedserve"
# The largest frame any peer may send. The largest real ones are a step's RequestUpdates with
# prompt logprobs of a long prompt (about 33 MB at 128k tokens and 20 top logprobs).
MAX_FRAME_BYTES = 64 << 20

log = logging.getLogger("pagedserve.curve")


class InsecureEndpoint(ValueError):
    """A server asked to listen on a network address without CURVE keys."""


class KeysError(ValueError):
    """A keys folder that is missing or incomplete for the role asked of it."""


def is_local(endpoint: str) -> bool:
    """ipc://, inproc:// and loopback tcp:// endpoints: only this host can reach them."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # *, an interface name or a host name: may be reachable from elsewhere
        return False


@dataclass(frozen=True)
class CurveKeys:
    """What one process holds of a keys folder; a role's keys are None when the folder lacks them."""
    folder: str
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes | None
    client_secret: bytes | None

    @classmethod
    def load(cls, folder: str) -> "CurveKeys":
        root = Path(folder)
        if not (root / "server.key").is_file() and not (root / "server.key_secret").is_file():
            raise KeysError(f"{folder}: no server.key (make the folder with `pagedserve keys {folder}`)")
        try:
            server = zmq.auth.load_certificate(_either(root, "server"))
            client = zmq.auth.load_certificate(root / "client.key_secret") \
                if (root / "client.key_secret").is_file() else (None, None)
        except (OSError, ValueError) as e:
            raise KeysError(f"{folder}: {e}") from None
        return cls(folder, server[0], server[1], client[0], client[1])

    @classmethod
    def from_setting(cls, folder: str | None) -> "CurveKeys | None":
        """--curve-keys, or else $PAGEDSERVE_CURVE_KEYS; None when neither names a folder."""
        folder = folder or os.environ.get(KEYS_ENV, "")
        return cls.load(folder) if folder else None

    def authorized(self) -> Path:
        return Path(self.folder) / "authorized"


def _either(root: Path, name: str) -> Path:
    # A process that only connects needs the server's public key alone.
    secret = root / f"{name}.key_secret"
    return secret if secret.is_file() else root / f"{name}.key"


def make_keys(folder: str) -> bool:
    """Write a server and a client keypair and authorize the client; False (nothing written) when
    the folder already has them, so a compose stack's key service may run on every `up`."""
    root = Path(folder)
    if (root / "server.key_secret").is_file() and (root / "client.key_secret").is_file():
        return False
    root.mkdir(parents=True, exist_ok=True)
    (root / "authorized").mkdir(exist_ok=True)
    zmq.auth.create_certificates(str(root), "server")
    public, _ = zmq.auth.create_certificates(str(root), "client")
    (root / "authorized" / "client.key").write_bytes(Path(public).read_bytes())
    for secret in root.glob("*.key_secret"):
        secret.chmod(0o600)
    return True


class SocketGuard:
    """One process's view of the rules above: listen() and connect() set a socket up, close()
    stops the authenticator and the monitors (before the context is terminated)."""

    def __init__(self, keys: CurveKeys | None, logger: logging.Logger | None = None):
        self.keys = keys
        self.log = logger or log
        self._auth: dict[int, ThreadAuthenticator] = {}
        self._monitors: list[tuple[zmq.Socket, threading.Thread]] = []
        self._stop = threading.Event()       # tells the monitor threads to end (close)

    @classmethod
    def from_setting(cls, folder: str | None, logger: logging.Logger | None = None) -> "SocketGuard":
        return cls(CurveKeys.from_setting(folder), logger)

    def check_listen(self, endpoint: str) -> None:
        """InsecureEndpoint (before anything is bound) for a network address without keys."""
        if self.keys is None and not is_local(endpoint):
            raise InsecureEndpoint(
                f"refusing to listen on {endpoint} without CURVE keys: anyone on that network could "
                f"drive this process. Give --curve-keys DIR (or ${KEYS_ENV}; make one with "
                f"`pagedserve keys DIR`), or listen on ipc:// or 127.0.0.1")
        if self.keys is not None and self.keys.server_secret is None:
            raise KeysError(f"{self.keys.folder}: a listening process needs server.key_secret")

    def listen(self, sock: zmq.Socket, endpoint: str) -> None:
        """Bind a server socket (ROUTER): CURVE with the allow-list when there are keys."""
        self.check_listen(endpoint)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if self.keys is not None:
            self._authenticator(sock.context)
            sock.curve_secretkey = self.keys.server_secret
            sock.curve_publickey = self.keys.server_public
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.curve_server = True
        self._watch(sock, endpoint)
        sock.bind(endpoint)

    def connect(self, sock: zmq.Socket, endpoint: str) -> None:
        """Connect a client socket (DEALER): CURVE with the client keypair when there are keys."""
        if self.keys is not None:
            if self.keys.client_secret is None:
                raise KeysError(f"{self.keys.folder}: a connecting process needs client.key_secret")
            sock.curve_serverkey = self.keys.server_public
            sock.curve_publickey = self.keys.client_public
            sock.curve_secretkey = self.keys.client_secret
        sock.connect(endpoint)

    def close(self) -> None:
        """Before the context goes: a monitor thread still inside recv when the context is
        destroyed aborts the process in libzmq (signaler.cpp: pfd.revents & POLLIN, seen at a
        scheduler's stop under load, when a 2 s join had timed out). Each thread polls in short
        slices and sees the stop flag, so the join always ends, and ends before any destroy."""
        self._stop.set()
        for sock, thread in self._monitors:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass                     # the socket is closed already
            thread.join()
        self._monitors = []
        self._stop = threading.Event()       # sockets watched after this get threads of their own
        for auth in self._auth.values():
            auth.stop()
        self._auth = {}

    # ---- internals ------------------------------------------------------------------------------
    def _authenticator(self, ctx: zmq.Context) -> None:
        if id(ctx) in self._auth:
            return
        # pyzmq's ZAP handler (logs at debug); the monitor below logs each refusal as a warning.
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagedserve.curve.zap"))
        auth.start()
        auth.configure_curve(domain=ZAP_DOMAIN, location=str(self.keys.authorized()))
        self._auth[id(ctx)] = auth

    def _watch(self, sock: zmq.Socket, endpoint: str) -> None:
        events = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        monitor = sock.get_monitor_socket(events)
        thread = threading.Thread(target=_log_events, args=(monitor, endpoint, self.log, self._stop),
                                  name=f"monitor {endpoint}", daemon=True)
        thread.start()
        self._monitors.append((sock, thread))


def _log_events(monitor: zmq.Socket, endpoint: str, logger: logging.Logger, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            if not monitor.poll(100):
                continue
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_MONITOR_STOPPED:
                break
            if event == zmq.EVENT_DISCONNECTED:
                logger.info("a peer of %s dropped its connection (gone, or it sent a frame over %d bytes)",
                            endpoint, MAX_FRAME_BYTES)
            else:
                logger.warning("refused a peer on %s: handshake failed (%s; no keys, wrong keys or not "
                               "ZeroMQ)", endpoint, zmq.Event(event).name)
    except zmq.ZMQError:   # the context went away under us (scheduler's destroy): nothing to log
        pass
    finally:
        monitor.close(linger=0)
