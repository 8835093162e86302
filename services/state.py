"""The state routers share: engine replicas and their leases, request records, API keys, rate limits.

Owns nothing in memory that another router needs: with several routers the store is Redis
(`RedisState`); one router alone (the embedded default, no --redis-url) keeps the same records in
process (`MemoryState`). Both implement `StateStore`, and the tests run the same checks on both.

Keys (Redis, under a prefix, default "pagedserve:"):
  replica:<id>          JSON {id, endpoint, info}, expires with the lease (PX)
  replicas              set of replica ids (pruned of expired ones on read)
  request:<id>          hash of the request record, expires `request_ttl_s` after its last write
  request:<id>:claim    held while the request runs: a second request of that id is refused
  apikey:<sha256>       JSON of the key's info (the key itself is never stored)
  rate:<sha256>         sorted set of the window's requests (score: their time): an exact sliding window

Calls are short round trips to a local Redis (~0.2 ms); the router makes them inline.
"""
from __future__ import annotations

import abc
import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_PREFIX = "pagedserve:"
REQUEST_TTL_S = 3600.0


@dataclass(frozen=True)
class Replica:
    """One engine replica (a scheduler endpoint) holding a live lease."""
    id: str
    endpoint: str
    info: dict = field(default_factory=dict)

    @property
    def load(self) -> float:
        """Requests in flight as the replica last reported them (its lease renewals carry it)."""
        info = self.info
        if "load" in info:
            return float(info["load"])
        return float(info.get("num_requests_running", 0)) + float(info.get("num_requests_waiting", 0))


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    count: float            # requests counted in the sliding window, this one included if allowed
    retry_after_s: float    # when a refused client may try again
    token: str = ""         # names the request counted, for refund_rate_limit


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class StateStore(abc.ABC):
    """What routers (and schedulers, for their leases) share."""

    # ---- replicas ------------------------------------------------------------------------------
    @abc.abstractmethod
    def register_replica(self, replica_id: str, endpoint: str, info: dict | None = None,
                         ttl_s: float = 10.0) -> None:
        """Announce a replica; it stays listed while it renews within ttl_s."""

    @abc.abstractmethod
    def renew_replica(self, replica_id: str, ttl_s: float = 10.0, info: dict | None = None) -> bool:
        """Extend the lease (and replace info when given); False if the lease had already expired,
        in which case the replica must register again."""

    def renew(self, replica_id: str, ttl_s: float = 10.0, info: dict | None = None) -> bool:
        return self.renew_replica(replica_id, ttl_s, info)

    @abc.abstractmethod
    def deregister_replica(self, replica_id: str) -> None: ...

    @abc.abstractmethod
    def live_replicas(self) -> list[Replica]:
        """Replicas whose lease has not expired, sorted by id."""

    # ---- request records -----------------------------------------------------------------------
    @abc.abstractmethod
    def put_request(self, request_id: str, router_id: str, replica_endpoint: str, status: str,
                    ttl_s: float = REQUEST_TTL_S, **fields: Any) -> bool:
        """Create a record; False (and nothing written) if a request of that id is running. The
        record of a finished one is replaced (a client retrying with its id, as vLLM allows); a
        running id stays taken, so that lookups and cancels by id have one owner."""

    @abc.abstractmethod
    def get_request(self, request_id: str) -> dict | None: ...

    @abc.abstractmethod
    def update_request_status(self, request_id: str, status: str, ttl_s: float = REQUEST_TTL_S,
                              **fields: Any) -> bool:
        """Set the status (and any other fields); False if there is no such record."""

    # ---- API keys and rate limits --------------------------------------------------------------
    @abc.abstractmethod
    def add_api_key(self, key: str, info: dict | None = None) -> None:
        """info may hold "name" and "rate_limit" (requests per window; None = the router's default)."""

    @abc.abstractmethod
    def remove_api_key(self, key: str) -> None: ...

    @abc.abstractmethod
    def check_api_key(self, key: str) -> dict | None:
        """The key's info, or None for an unknown key."""

    @abc.abstractmethod
    def hit_rate_limit(self, key: str, limit: int, window_s: float = 60.0, count: bool = True) -> RateDecision:
        """Count one request for this key in an exact sliding window: allowed when fewer than
        `limit` were counted in the last window_s seconds. A refused request is not counted;
        count=False only asks whether one more would be allowed."""

    @abc.abstractmethod
    def refund_rate_limit(self, key: str, token: str) -> None:
        """Uncount the request a hit_rate_limit counted (one refused as invalid uses no quota)."""

    def close(self) -> None:
        pass


def _rate_token() -> str:
    return secrets.token_hex(8)


# ------------------------------------------------------------------------------------------------

class MemoryState(StateStore):
    """In-process store for a single router. `clock` is injectable so lease expiry tests need not sleep."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._replicas: dict[str, tuple[float, Replica]] = {}     # id -> (expires at, replica)
        self._requests: dict[str, tuple[float, dict]] = {}
        self._keys: dict[str, dict] = {}
        self._rates: dict[str, dict[str, float]] = {}     # key digest -> {token: time counted}

    def register_replica(self, replica_id, endpoint, info=None, ttl_s=10.0):
        with self._lock:
            self._replicas[replica_id] = (self._clock() + ttl_s, Replica(replica_id, endpoint, dict(info or {})))

    def renew_replica(self, replica_id, ttl_s=10.0, info=None):
        with self._lock:
            entry = self._replicas.get(replica_id)
            if entry is None or entry[0] <= self._clock():
                self._replicas.pop(replica_id, None)
                return False
            rep = entry[1] if info is None else Replica(replica_id, entry[1].endpoint, dict(info))
            self._replicas[replica_id] = (self._clock() + ttl_s, rep)
            return True

    def deregister_replica(self, replica_id):
        with self._lock:
            self._replicas.pop(replica_id, None)

    def live_replicas(self):
        with self._lock:
            now = self._clock()
            for rid in [r for r, (exp, _) in self._replicas.items() if exp <= now]:
                del self._replicas[rid]
            return [rep for _, (_, rep) in sorted(self._replicas.items())]

    def put_request(self, request_id, router_id, replica_endpoint, status, ttl_s=REQUEST_TTL_S, **fields):
        with self._lock:
            now = self._clock()
            entry = self._requests.get(request_id)
            if entry is not None and entry[0] > now and entry[1]["status"] == "running":
                return False
            self._purge_requests(now)
            record = {"request_id": request_id, "router_id": router_id, "replica_endpoint": replica_endpoint,
                      "status": status, "created": self._wall(), "updated": self._wall(), **fields}
            self._requests[request_id] = (now + ttl_s, record)
            return True

    def _purge_requests(self, now: float) -> None:
        # Bounded memory without a timer: expired records go whenever a new one is written.
        if len(self._requests) > 1024:
            for rid in [r for r, (exp, _) in self._requests.items() if exp <= now]:
                del self._requests[rid]

    def get_request(self, request_id):
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None or entry[0] <= self._clock():
                return None
            return dict(entry[1])

    def update_request_status(self, request_id, status, ttl_s=REQUEST_TTL_S, **fields):
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None or entry[0] <= self._clock():
                return False
            record = {**entry[1], **fields, "status": status, "updated": self._wall()}
            self._requests[request_id] = (self._clock() + ttl_s, record)
            return True

    def add_api_key(self, key, info=None):
        with self._lock:
            self._keys[hash_api_key(key)] = dict(info or {})

    def remove_api_key(self, key):
        with self._lock:
            self._keys.pop(hash_api_key(key), None)

    def check_api_key(self, key):
        with self._lock:
            info = self._keys.get(hash_api_key(key))
            return None if info is None else dict(info)

    def hit_rate_limit(self, key, limit, window_s=60.0, count=True):
        h = hash_api_key(key)
        with self._lock:
            now = self._clock()
            if len(self._rates) > 1024:     # bounded memory (client addresses are keys too)
                for old in [k for k, v in self._rates.items() if max(v.values(), default=0) <= now - window_s]:
                    del self._rates[old]
            hits = {t: at for t, at in self._rates.get(h, {}).items() if at > now - window_s}
            self._rates[h] = hits
            if len(hits) >= limit:
                return RateDecision(False, len(hits), max(0.001, min(hits.values()) + window_s - now))
            if not count:
                return RateDecision(True, len(hits), 0.0)
            token = _rate_token()
            hits[token] = now
            return RateDecision(True, len(hits), 0.0, token)

    def refund_rate_limit(self, key, token):
        with self._lock:
            self._rates.get(hash_api_key(key), {}).pop(token, None)


# ------------------------------------------------------------------------------------------------

def redact_url(url: str | None) -> str | None:
    """A Redis URL fit for a log line: its password (redis://:pw@host, redis://user:pw@host) hidden."""
    from urllib.parse import urlsplit
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def redis_start_failure(process: str, url: str | None, error: Exception) -> bool:
    """True, with the cause on stderr, when a process's start-up error is redis-py's (it raises
    ConnectionError, TimeoutError, AuthenticationError...: no common base): the operator's to fix,
    reported in one line. False for anything else, which the caller raises on."""
    if not type(error).__module__.startswith("redis"):
        return False
    import sys
    print(f"{process}: cannot use Redis at {redact_url(url)}: {error}", file=sys.stderr)
    return True


class RedisState(StateStore):
    """The shared store. Every key sits under `prefix`, so tests (and stacks) can share one server."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = DEFAULT_PREFIX,
                 socket_timeout_s: float = 2.0, client=None):
        import redis
        self.prefix = prefix
        # A timeout, so a Redis that stops answering fails the call instead of hanging the router.
        self.r = client or redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                                socket_connect_timeout=socket_timeout_s,
                                                decode_responses=True)

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def register_replica(self, replica_id, endpoint, info=None, ttl_s=10.0):
        body = json.dumps({"id": replica_id, "endpoint": endpoint, "info": info or {}})
        pipe = self.r.pipeline()
        pipe.set(self._k("replica", replica_id), body, px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self._k("replicas"), replica_id)
        pipe.execute()

    def renew_replica(self, replica_id, ttl_s=10.0, info=None):
        key = self._k("replica", replica_id)
        px = max(1, int(ttl_s * 1000))
        if info is None:
            return bool(self.r.pexpire(key, px))
        raw = self.r.get(key)
        if raw is None:
            return False
        body = json.loads(raw)
        body["info"] = info
        # xx: never resurrect a lease that expired between the GET and the SET.
        return bool(self.r.set(key, json.dumps(body), px=px, xx=True))

    def deregister_replica(self, replica_id):
        pipe = self.r.pipeline()
        pipe.delete(self._k("replica", replica_id))
        pipe.srem(self._k("replicas"), replica_id)
        pipe.execute()

    def live_replicas(self):
        ids = sorted(self.r.smembers(self._k("replicas")))
        if not ids:
            return []
        raws = self.r.mget([self._k("replica", i) for i in ids])
        out, dead = [], []
        for rid, raw in zip(ids, raws):
            if raw is None:
                dead.append(rid)
                continue
            body = json.loads(raw)
            out.append(Replica(body["id"], body["endpoint"], body.get("info") or {}))
        if dead:
            self.r.srem(self._k("replicas"), *dead)
        return out

    # Request records are hashes of JSON-encoded values, so numbers and lists survive the trip.
    def put_request(self, request_id, router_id, replica_endpoint, status, ttl_s=REQUEST_TTL_S, **fields):
        key = self._k("request", request_id)
        now = time.time()
        record = {"request_id": request_id, "router_id": router_id, "replica_endpoint": replica_endpoint,
                  "status": status, "created": now, "updated": now, **fields}
        # SET NX on a guard claims the id atomically while the request runs (its end releases
        # the guard); the hash follows, replacing a finished request's record.
        if not self.r.set(key + ":claim", "1", nx=True, px=max(1, int(ttl_s * 1000))):
            return False
        pipe = self.r.pipeline()
        pipe.delete(key)
        pipe.hset(key, mapping={k: json.dumps(v) for k, v in record.items()})
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        pipe.execute()
        return True

    def get_request(self, request_id):
        raw = self.r.hgetall(self._k("request", request_id))
        return {k: json.loads(v) for k, v in raw.items()} if raw else None

    def update_request_status(self, request_id, status, ttl_s=REQUEST_TTL_S, **fields):
        key = self._k("request", request_id)
        if not self.r.exists(key):
            return False
        mapping = {k: json.dumps(v) for k, v in {**fields, "status": status, "updated": time.time()}.items()}
        px = max(1, int(ttl_s * 1000))
        pipe = self.r.pipeline()
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, px)
        if status == "running":
            pipe.pexpire(key + ":claim", px)
        else:
            pipe.delete(key + ":claim")     # over: the id may be used again
        pipe.execute()
        return True

    def add_api_key(self, key, info=None):
        self.r.set(self._k("apikey", hash_api_key(key)), json.dumps(info or {}))

    def remove_api_key(self, key):
        self.r.delete(self._k("apikey", hash_api_key(key)))

    def check_api_key(self, key):
        raw = self.r.get(self._k("apikey", hash_api_key(key)))
        return None if raw is None else json.loads(raw)

    # One atomic step for every router: drop what left the window, count, add this one if it fits.
    # Returns {allowed, count, oldest score}. Time is the caller's (routers keep NTP-close clocks).
    _HIT = """
        redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1] - ARGV[2])
        local n = redis.call('ZCARD', KEYS[1])
        if n >= tonumber(ARGV[3]) then
            local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
            return {0, n, oldest[2]}
        end
        if ARGV[5] == '1' then
            redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
            redis.call('PEXPIRE', KEYS[1], math.ceil(ARGV[2] * 1000) + 1000)
            n = n + 1
        end
        return {1, n, '0'}
    """

    def hit_rate_limit(self, key, limit, window_s=60.0, count=True):
        now, token = time.time(), _rate_token()
        allowed, n, oldest = self.r.eval(self._HIT, 1, self._k("rate", hash_api_key(key)), repr(now),
                                         repr(window_s), str(limit), token, "1" if count else "0")
        if not allowed:
            return RateDecision(False, n, max(0.001, float(oldest) + window_s - now))
        return RateDecision(True, n, 0.0, token if count else "")

    def refund_rate_limit(self, key, token):
        self.r.zrem(self._k("rate", hash_api_key(key)), token)

    def clear(self) -> int:
        """Delete every key under this store's prefix (tests; tearing down a stack)."""
        keys = list(self.r.scan_iter(match=self.prefix + "*", count=500))
        if keys:
            self.r.delete(*keys)
        return len(keys)

    def close(self) -> None:
        self.r.close()


def make_state(redis_url: str | None, prefix: str = DEFAULT_PREFIX) -> StateStore:
    """Redis when a URL is given (several routers), else the in-process store (one router)."""
    return RedisState(redis_url, prefix=prefix) if redis_url else MemoryState()
