"""The remote tier's capacity accounting: one Redis hash every node shares, changed only by Lua
scripts, and its recount from what the store holds.

The hash ``<prefix>:usage`` has these fields:

    bytes, blocks           the values stored, as their writers and deleters accounted them
    reserved                bytes the intents below reserve
    i:<key hex>:<op>        an operation in flight on a block: "<reserved> <deadline ms> <length
                            before>" (a put reserves its value's bytes, a delete nothing)
    recount                 "<token> <deadline ms>" while a recount runs
    t:<key hex>             "<length before>": a block an operation touched while it ran

Everything is in one key, so every script touches one key and runs on a cluster too.

A put reads the value's length, declares its intent (the script checks ``bytes + reserved +
size - length <= capacity``), SETs, then settles (drops the intent and its reservation, adds
``size - length`` to bytes and a block when the value is new). A delete reads the length,
declares a zero-byte intent, DELs, then settles (``-length``, a block less). Deadlines are the
server's clock plus a lease: a writer killed mid-put leaves an intent that stops counting when
its lease runs out (a put short of room prunes expired intents before it refuses, so a dead
writer's reservation never keeps the tier full past its lease). What such a writer left in
``bytes`` (a value stored but never added, a delete never subtracted) and what changed behind
Strata's back (a value evicted by Redis under maxmemory, a key deleted by hand) are the
recount's to correct.

The recount walks the store with SCAN in bounded batches and STRLENs each value, but a walk is
no snapshot: writers keep going while it runs, and the walk passes each key at its own moment.
So it never overwrites ``bytes`` and ``blocks``; it corrects them by a delta, and for the blocks
an operation touched while it ran, it does not trust the length it read:

1. Begin (one script): note ``bytes`` and ``blocks`` (S0), mark ``recount`` active, and mark
   every block with an intent in flight as touched, with its length before that operation.
   While the recount runs, every new intent marks its block too (the first mark stays).
2. Walk: SCAN and STRLEN every value, remembering the length read per block.
3. Finish (one script, after reading the marks): ``bytes += held - S0 + sum over marked blocks
   of (length before - length the walk read for it, 0 if none)``, likewise for ``blocks``; the
   marks and ``recount`` go, ``reserved`` is recomputed from the intents still live.

An unmarked block had no operation whose accounting came after S0 (each operation marks its
block before it touches the value), so the length the walk read is the truth and ``bytes``
changed by nothing of it since S0. A marked block counts its length before its first operation
since S0 plus what that operation and later ones added to ``bytes`` after S0: what it holds now,
or held before an operation still in flight, whose settle adds the rest - whether the walk passed
its key before, during or after those operations. A mark read too late for the finish belongs to
an operation declared after the walk ended, which the walk cannot have seen: its block counts
the length read, its length before, anyway.

So a live reservation is never touched (intents are apart from ``bytes``), and every put and
delete that lands while the recount runs is counted once. What a recount cannot see - a writer
killed between its SET and its settle while the recount runs, a value evicted behind Strata's
back from a block an operation touched meanwhile - the next recount finds. One recount runs at a
time per prefix (a second one finds ``recount`` active and does nothing); its lease is renewed
while it walks, so one killed mid-walk stops holding it within the lease. The walk remembers the
length it read per block (SCAN may return a key twice), one entry per stored block, as the
reconciler's key listing does.

Scripts call TIME before writing, which Redis allows from 5.0 (scripts replicate their
effects); Valkey always has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import redis.exceptions

from worker.dataplane.tiers.remote.client import RedisClient

_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function prune(usage, now)
  local all = redis.call('HGETALL', usage)
  local n, freed = 0, 0
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 'i:' then
      local size, deadline = string.match(all[i + 1], '^(%d+) (%d+)')
      if size == nil or tonumber(deadline) <= now then
        redis.call('HDEL', usage, all[i])
        n = n + 1
        freed = freed + tonumber(size or '0')
      end
    end
  end
  if freed > 0 then redis.call('HINCRBY', usage, 'reserved', -freed) end
  return {n, freed}
end
local function recount_token(usage, now)
  local r = redis.call('HGET', usage, 'recount')
  if not r then return nil end
  local token, deadline = string.match(r, '^(%S+) (%d+)$')
  if deadline == nil or tonumber(deadline) <= now then return nil end
  return token
end
"""

_INTENT = (
    _COMMON
    + """
-- ARGV: field, key hex, bytes to reserve, length before, capacity (-1: none), lease ms
local usage = KEYS[1]
local now = now_ms()
local size, before, capacity = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local function used()
  local v = redis.call('HMGET', usage, 'bytes', 'reserved')
  return math.max(0, tonumber(v[1] or '0')) + math.max(0, tonumber(v[2] or '0'))
end
local u = used()
if capacity >= 0 and u + size - before > capacity then
  prune(usage, now)
  u = used()
  if u + size - before > capacity then return {0, u} end
end
if size > 0 then redis.call('HINCRBY', usage, 'reserved', size) end
redis.call('HSET', usage, ARGV[1], size .. ' ' .. (now + tonumber(ARGV[6])) .. ' ' .. before)
if recount_token(usage, now) then redis.call('HSETNX', usage, 't:' .. ARGV[2], before) end
return {1, u}
"""
)

_SETTLE = """
-- ARGV: field, bytes change, blocks change
local usage = KEYS[1]
local v = redis.call('HGET', usage, ARGV[1])
if v then
  redis.call('HDEL', usage, ARGV[1])
  local size = tonumber(string.match(v, '^(%d+)') or '0')
  if size > 0 then redis.call('HINCRBY', usage, 'reserved', -size) end
end
if tonumber(ARGV[2]) ~= 0 then redis.call('HINCRBY', usage, 'bytes', ARGV[2]) end
if tonumber(ARGV[3]) ~= 0 then redis.call('HINCRBY', usage, 'blocks', ARGV[3]) end
return 1
"""

_BEGIN = (
    _COMMON
    + """
-- ARGV: token, lease ms
local usage = KEYS[1]
local now = now_ms()
if recount_token(usage, now) then return {0} end
local all = redis.call('HGETALL', usage)
for i = 1, #all, 2 do
  local kind = string.sub(all[i], 1, 2)
  if kind == 't:' then
    redis.call('HDEL', usage, all[i])  -- left by a recount that did not finish
  end
end
for i = 1, #all, 2 do
  local hex = string.match(all[i], '^i:(%x+):')
  if hex then
    redis.call('HSETNX', usage, 't:' .. hex, string.match(all[i + 1], '^%d+ %d+ (%d+)$') or '0')
  end
end
local pruned = prune(usage, now)
redis.call('HSET', usage, 'recount', ARGV[1] .. ' ' .. (now + tonumber(ARGV[2])))
local v = redis.call('HMGET', usage, 'bytes', 'blocks')
return {1, tonumber(v[1] or '0'), tonumber(v[2] or '0'), pruned[2]}
"""
)

_RENEW = (
    _COMMON
    + """
-- ARGV: token, lease ms
local now = now_ms()
if recount_token(KEYS[1], now) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'recount', ARGV[1] .. ' ' .. (now + tonumber(ARGV[2])))
return 1
"""
)

_FINISH = (
    _COMMON
    + """
-- ARGV: token, bytes change, blocks change (0, 0 to give the recount up)
local usage = KEYS[1]
local now = now_ms()
if recount_token(usage, now) ~= ARGV[1] then return {0} end
local pruned = prune(usage, now)
local all = redis.call('HGETALL', usage)
local reserved = 0
for i = 1, #all, 2 do
  local kind = string.sub(all[i], 1, 2)
  if kind == 't:' then
    redis.call('HDEL', usage, all[i])
  elseif kind == 'i:' then
    reserved = reserved + tonumber(string.match(all[i + 1], '^(%d+)') or '0')
  end
end
local counted = tonumber(redis.call('HGET', usage, 'reserved') or '0')
redis.call('HSET', usage, 'reserved', reserved)
redis.call('HDEL', usage, 'recount')
local bytes = redis.call('HINCRBY', usage, 'bytes', ARGV[2])
local blocks = redis.call('HINCRBY', usage, 'blocks', ARGV[3])
return {1, bytes, blocks, reserved, counted - reserved + pruned[2]}
"""
)

RECOUNT_LEASE_S = 60.0
"""A recount's hold on the hash lapses this long after its last renewal (renewed every third of
it while the walk runs)."""


@dataclasses.dataclass(frozen=True)
class Counted:
    """The hash's counts: stored bytes and blocks, and bytes reserved by puts in flight."""

    bytes: int
    blocks: int
    reserved: int


@dataclasses.dataclass(frozen=True)
class Recounted:
    """A recount's corrections (counted minus held) and the counts it left."""

    drift_bytes: int
    drift_blocks: int
    counted: Counted


def _run(script: Any, key: str, *args: object) -> Any:
    """Run a script on the usage hash. Past maxmemory, Redis 7 refuses a writing script up front
    (OutOfMemoryError) and older servers fail the script at its first write (a ResponseError
    naming OOM): both are OutOfMemoryError here."""
    try:
        return script(keys=[key], args=list(args))
    except redis.exceptions.ResponseError as exc:
        if "OOM command not allowed" in str(exc) and not isinstance(exc, redis.exceptions.OutOfMemoryError):
            raise redis.exceptions.OutOfMemoryError(str(exc)) from exc
        raise


class UsageHash:
    """The usage hash of one key prefix: intents, settles, counts and recounts."""

    def __init__(self, client: RedisClient, *, prefix: str, lease_s: float) -> None:
        if lease_s <= 0:
            raise ValueError(f"an intent's lease must be more than 0 seconds, got {lease_s}")
        self.client = client
        self.key = f"{prefix}:usage"
        self.block_prefix = f"{prefix}:blk:".encode()
        self.lease_ms = int(lease_s * 1000)
        self.writer = secrets.token_hex(6)
        """Tells this process's intents from other writers' (with a counter per operation)."""
        self._ops = itertools.count()
        self._intent = client.register_script(_INTENT)
        self._settle = client.register_script(_SETTLE)
        self._begin = client.register_script(_BEGIN)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)

    # -- operations -------------------------------------------------------------------------
    def reserve(self, key: uuid.UUID, *, size: int, before: int, capacity: int) -> tuple[bytes | None, int]:
        """Declare a put of `size` bytes over a value `before` bytes long, reserving its bytes
        while `capacity` has room. Returns the intent's field (None: no room) and the bytes
        used before it."""
        return self._declare(key, size=size, before=before, capacity=capacity)

    def declare(self, key: uuid.UUID, *, before: int) -> bytes:
        """Declare a delete of a value `before` bytes long (nothing reserved). Returns its field."""
        field, _ = self._declare(key, size=0, before=before, capacity=-1)
        assert field is not None  # without a capacity nothing is refused
        return field

    def _declare(self, key: uuid.UUID, *, size: int, before: int, capacity: int) -> tuple[bytes | None, int]:
        field = f"i:{key.hex}:{self.writer}.{next(self._ops)}".encode()
        ok, used = cast(
            list[int],
            _run(self._intent, self.key, field, key.hex, size, before, capacity, self.lease_ms),
        )
        return (field if ok else None), int(used)

    def settle(self, field: bytes, *, nbytes: int = 0, blocks: int = 0) -> None:
        """The operation is over: its intent and reservation go, `nbytes` and `blocks` are added."""
        _run(self._settle, self.key, field, nbytes, blocks)

    def counted(self) -> Counted:
        raw = cast(list[Any], self.client.hmget(self.key, [b"bytes", b"blocks", b"reserved"]))
        values = [int(v) if v is not None else 0 for v in raw]
        return Counted(bytes=max(0, values[0]), blocks=max(0, values[1]), reserved=max(0, values[2]))

    # -- the recount ------------------------------------------------------------------------
    def recount(self, *, batch: int = 1000) -> Recounted | None:
        """Correct bytes, blocks and reserved to what the store holds (see the module's
        docstring for why this is safe beside writers). None when another recount holds the
        hash, or took it over after this one's lease lapsed."""
        if batch < 1:
            raise ValueError(f"a recount batch must be at least 1 key, got {batch}")
        token = f"{self.writer}.{next(self._ops)}"
        begun = cast(list[int], _run(self._begin, self.key, token, int(RECOUNT_LEASE_S * 1000)))
        if not begun[0]:
            return None
        start_bytes, start_blocks, expired = (int(v) for v in begun[1:])
        try:
            held_bytes, held_blocks, seen = self._walk(token, batch)
            fix_bytes = fix_blocks = 0
            for field, value in cast(dict[bytes, bytes], self.client.hgetall(self.key)).items():
                if field.startswith(b"t:"):
                    before, held = int(value), seen.get(int(field[2:], 16), 0)
                    fix_bytes += before - held
                    fix_blocks += (before > 0) - (held > 0)
            change_bytes = held_bytes + fix_bytes - start_bytes
            change_blocks = held_blocks + fix_blocks - start_blocks
            done = cast(list[int], _run(self._finish, self.key, token, change_bytes, change_blocks))
        except RecountLost:
            return None
        except BaseException:
            with contextlib.suppress(Exception):  # give the hash back; the walk's error is the one to report
                _run(self._finish, self.key, token, 0, 0)
            raise
        if not done[0]:
            return None
        stored, blocks, reserved, reserved_drift = (int(v) for v in done[1:])
        return Recounted(
            drift_bytes=expired + reserved_drift - change_bytes,
            drift_blocks=-change_blocks,
            counted=Counted(bytes=max(0, stored), blocks=max(0, blocks), reserved=max(0, reserved)),
        )

    def _walk(self, token: str, batch: int) -> tuple[int, int, dict[int, int]]:
        """SCAN the block values and STRLEN each. Returns the bytes and blocks held, and the
        length read per block (by key)."""
        seen: dict[int, int] = {}
        held_bytes = held_blocks = 0
        renew_every = RECOUNT_LEASE_S / 3
        renew_at = time.monotonic() + renew_every
        for names in self._batches(batch):
            fresh: list[tuple[int, bytes]] = []
            for name in names:
                try:
                    ident = uuid.UUID(hex=name[len(self.block_prefix) :].decode()).int
                except ValueError:
                    continue  # not a block value of this tier
                if ident not in seen:
                    seen[ident] = 0
                    fresh.append((ident, name))
            if fresh:
                pipe = self.client.pipeline(transaction=False)
                for _, name in fresh:
                    pipe.strlen(name)
                for (ident, _), length in zip(fresh, pipe.execute(), strict=True):
                    seen[ident] = int(length)
                    held_bytes += int(length)
                    held_blocks += int(length) > 0
            if time.monotonic() >= renew_at:
                if not _run(self._renew, self.key, token, int(RECOUNT_LEASE_S * 1000)):
                    raise RecountLost(self.key)
                renew_at = time.monotonic() + renew_every
        return held_bytes, held_blocks, seen

    def _batches(self, batch: int) -> Iterator[list[bytes]]:
        names: list[bytes] = []
        for name in self.client.scan_iter(match=self.block_prefix + b"*", count=batch):
            names.append(name)
            if len(names) == batch:
                yield names
                names = []
        if names:
            yield names


class RecountLost(Exception):
    """A recount's lease lapsed mid-walk (and another recount may hold the hash now)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the recount of {key} lost its lease mid-walk")
