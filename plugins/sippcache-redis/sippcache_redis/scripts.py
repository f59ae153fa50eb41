"""The server-side half of the backend: four Lua scripts on the metadata slot.

Every script gets the same four keys, all with the hash tag ``{<prefix>}`` so
that a cluster keeps them on one node and a script may touch them together:

    KEYS[1] {p}:state  hash: epoch (random, set when the store is created),
                       seq (newest log record), clock (the eviction clock),
                       max_bytes and max_entries (the budget saved with the
                       store: digits or "none"; absent until a handle saves one)
    KEYS[2] {p}:cat    hash: entry id -> blob id (8 bytes) + msgpack metadata
    KEYS[3] {p}:val    hash: entry id -> 18 bytes: used (u64 BE, ns), value (f64 BE),
                       pinned (1 byte), superseded (1 byte)
    KEYS[4] {p}:log    stream: record <seq>-0 with fields k (kind) and e (entry id)
                       or d (touch data)

Each script first repairs what it cannot use (a key of the wrong type is
deleted; a state without a valid epoch or seq starts a new epoch, which makes
every client rebuild from ``cat``/``val``), then does its change, appending
one log record per change, then returns what the caller needs to bring its
mirror up to date::

    {epoch, seq, clock, status, records, result, budget}

`status` is "ok" (records bring the caller to `seq`), "more" (a bounded page:
call again), or "rebuild" (the caller's epoch or position is unknown here, or
records are missing: rebuild from the hashes). Each record is
``{seq, kind, a, b, c}``: for a put, the entry's *current* metadata and
values (false once it is gone); for a value change, its current values; for
touches, the 32-byte items (id, used, value); nothing more for delete and clear.
The kinds are `sippcache.catalog.Op`'s codes, spliced in below. `budget` is
``{max_bytes, max_entries}`` as the state holds them (false when absent), so
every reply brings the store's budget and no log record is needed for it.

Scripts that only ever write a few bytes (sync, delete, clear, budget) may run when
the server is out of memory (``allow-oom``), so lookups and deletes keep
working under ``maxmemory`` with ``noeviction``; ``commit`` may not, so a full
server refuses a store before it changes anything.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from sippcache.plugin import Op

#: Log records kept in the stream (approximately: XADD MAXLEN ~); a client further behind rebuilds.
LOG_KEEP = 10_000

_COMMON = (
    """
local S, C, V, L = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local KEEP = """
    + str(LOG_KEEP)
    + "\nlocal PUT, DELETE, TOUCH, VALUES, CLEAR = "
    + ", ".join(f"'{op}'" for op in (Op.PUT, Op.DELETE, Op.TOUCH, Op.VALUES, Op.CLEAR))
    + """
local epoch, seq, clock
local budget = {false, false}
local added = 0

local function ty(k) return redis.call('TYPE', k)['ok'] end
local function num(n) return string.format('%.0f', n) end

-- Open the store: repair what is unusable, create it if needed (with `candidate` as epoch).
local function open_store(candidate)
  local renew = false
  for _, k in ipairs({C, V}) do
    local t = ty(k)
    if t ~= 'hash' and t ~= 'none' then redis.call('DEL', k); renew = true end
  end
  local t = ty(L)
  if t ~= 'stream' and t ~= 'none' then redis.call('DEL', L) end
  t = ty(S)
  if t == 'hash' then
    local v = redis.call('HMGET', S, 'epoch', 'seq', 'clock', 'max_bytes', 'max_entries')
    epoch, seq, clock, budget = v[1], tonumber(v[2]), v[3], {v[4], v[5]}
  elseif t ~= 'none' then
    redis.call('DEL', S)
  end
  if renew or not epoch or not seq or seq < 0 or seq ~= math.floor(seq) or seq >= 2^52 then
    epoch, seq, clock = candidate, 0, '0'
    redis.call('DEL', S, L)
    redis.call('HSET', S, 'epoch', epoch, 'seq', '0', 'clock', '0')
    if budget[1] and budget[2] then redis.call('HSET', S, 'max_bytes', budget[1], 'max_entries', budget[2]) end
  end
  if not clock then clock = '0' end
end

-- Append one log record. A log that refuses it (someone wrote a larger id) is dropped:
-- clients then find records missing and rebuild.
local function append(kind, field, value)
  seq = seq + 1
  local id = num(seq) .. '-0'
  local r = redis.pcall('XADD', L, 'MAXLEN', '~', KEEP, id, 'k', kind, field, value)
  if type(r) == 'table' and r.err then
    redis.call('DEL', L)
    redis.call('XADD', L, id, 'k', kind, field, value)
  end
  added = added + 1
end

local function finish()
  if added > 0 then redis.call('HSET', S, 'seq', num(seq), 'clock', clock) end
end

-- The records after `client_seq`, at most `max`, with the current data they refer to.
local function records(client_epoch, client_seq, max)
  if epoch ~= client_epoch or not client_seq or client_seq < 0 or client_seq > seq then
    return 'rebuild', {}
  end
  if client_seq == seq then return 'ok', {} end
  local got = redis.call('XRANGE', L, num(client_seq + 1) .. '-0', '+', 'COUNT', max)
  local out = {}
  local expect = client_seq + 1
  for _, e in ipairs(got) do
    if e[1] ~= num(expect) .. '-0' then return 'rebuild', {} end
    local f = {}
    for i = 1, #e[2], 2 do f[e[2][i]] = e[2][i + 1] end
    local kind, eid = f['k'], f['e'] or ''
    local rec
    if kind == PUT then
      rec = {expect, kind, eid, redis.call('HGET', C, eid), redis.call('HGET', V, eid)}
    elseif kind == VALUES then
      rec = {expect, kind, eid, false, redis.call('HGET', V, eid)}
    elseif kind == DELETE or kind == CLEAR then
      rec = {expect, kind, eid}
    elseif kind == TOUCH then
      rec = {expect, kind, f['d'] or ''}
    else
      return 'rebuild', {}
    end
    out[#out + 1] = rec
    expect = expect + 1
  end
  if #out == 0 then return 'rebuild', {} end
  if expect - 1 < seq then return 'more', out end
  return 'ok', out
end
"""
)

# ARGV: client epoch, client seq, candidate epoch, max records, then (id, used+value) pairs to touch.
# Result: the number of entries in `cat`; fewer than the caller's mirror holds means that
# metadata was lost outside the log (the server evicted `cat` under allkeys-lru): rebuild.
SYNC = (
    """#!lua flags=allow-oom
"""
    + _COMMON
    + """
open_store(ARGV[3])
if epoch == ARGV[1] and #ARGV > 4 then
  local applied = {}
  for i = 5, #ARGV - 1, 2 do
    local eid, uv = ARGV[i], ARGV[i + 1]
    local old = redis.call('HGET', V, eid)
    if old and #old == 18 and #uv == 16 and string.sub(old, 1, 8) < string.sub(uv, 1, 8) then
      redis.call('HSET', V, eid, uv .. string.sub(old, 17, 17) .. '\\0')
      applied[#applied + 1] = eid .. uv
    end
  end
  if #applied > 0 then append(TOUCH, 'd', table.concat(applied)) end
end
finish()
local status, recs = records(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4]))
return {epoch, seq, clock, status, recs, redis.call('HLEN', C), budget}
"""
)

# ARGV: client epoch, expected seq, candidate epoch, max records, clock,
#       n deletes, ids..., n values, (id, values)..., n puts, (id, meta, values)...
# Changes nothing unless the store is exactly at `expected seq` (the caller planned on
# that state); otherwise returns the records to catch up with and result 0.
COMMIT = (
    """#!lua
"""
    + _COMMON
    + """
open_store(ARGV[3])
local expected = tonumber(ARGV[2])
if epoch ~= ARGV[1] or seq ~= expected then
  local status, recs = records(ARGV[1], expected, tonumber(ARGV[4]))
  return {epoch, seq, clock, status, recs, 0, budget}
end
local i = 6
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local eid = ARGV[i]; i = i + 1
  redis.call('HDEL', C, eid); redis.call('HDEL', V, eid)
  append(DELETE, 'e', eid)
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local eid, vals = ARGV[i], ARGV[i + 1]; i = i + 2
  if redis.call('HEXISTS', C, eid) == 1 then
    redis.call('HSET', V, eid, vals)
    append(VALUES, 'e', eid)
  end
end
n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local eid, meta, vals = ARGV[i], ARGV[i + 1], ARGV[i + 2]; i = i + 3
  redis.call('HSET', C, eid, meta)
  redis.call('HSET', V, eid, vals)
  append(PUT, 'e', eid)
end
clock = ARGV[5]
finish()
return {epoch, seq, clock, 'ok', {}, 1, budget}
"""
)

# ARGV: client epoch, client seq, candidate epoch, max records, then (id, blob id or '') pairs.
# Deletes each entry (only if it still holds that blob, when one is given); returns the
# deleted metadata (false where nothing was deleted) so the caller can unlink the chunks.
DELETE = (
    """#!lua flags=allow-oom
"""
    + _COMMON
    + """
open_store(ARGV[3])
local deleted = {}
for i = 5, #ARGV - 1, 2 do
  local eid, blob = ARGV[i], ARGV[i + 1]
  local meta = redis.call('HGET', C, eid)
  if meta and (blob == '' or string.sub(meta, 1, 8) == blob) then
    redis.call('HDEL', C, eid); redis.call('HDEL', V, eid)
    append(DELETE, 'e', eid)
    deleted[#deleted + 1] = meta
  else
    deleted[#deleted + 1] = false
  end
end
finish()
local status, recs = records(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4]))
return {epoch, seq, clock, status, recs, deleted, budget}
"""
)

# ARGV: client epoch, expected seq, candidate epoch, max records, force ('1': clear whatever the seq).
# Without force, clears only at the expected seq, so the caller knows every entry whose
# chunks it must unlink.
CLEAR = (
    """#!lua flags=allow-oom
"""
    + _COMMON
    + """
open_store(ARGV[3])
local expected = tonumber(ARGV[2])
if ARGV[5] ~= '1' and (epoch ~= ARGV[1] or seq ~= expected) then
  local status, recs = records(ARGV[1], expected, tonumber(ARGV[4]))
  return {epoch, seq, clock, status, recs, 0, budget}
end
redis.call('UNLINK', C, V)
clock = '0'
append(CLEAR, 'e', '')
finish()
return {epoch, seq, clock, 'ok', {}, 1, budget}
"""
)

# ARGV: client epoch, client seq, candidate epoch, max records, max_bytes, max_entries
# (digits or "none"). Saves the budget with the store; every later reply returns it.
BUDGET = (
    """#!lua flags=allow-oom
"""
    + _COMMON
    + """
open_store(ARGV[3])
budget = {ARGV[5], ARGV[6]}
redis.call('HSET', S, 'max_bytes', budget[1], 'max_entries', budget[2])
local status, recs = records(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4]))
return {epoch, seq, clock, status, recs, 1, budget}
"""
)

# KEYS: a hash and a stream in the store's slot that nothing else uses. Runs every
# command the other scripts run, so an ACL that denies one fails here, at open.
PROBE = """#!lua flags=allow-oom
local h, s = KEYS[1], KEYS[2]
redis.call('TYPE', h)
redis.call('HSET', h, 'a', '1')
redis.call('HLEN', h)
redis.call('HGET', h, 'a')
redis.call('HMGET', h, 'a')
redis.call('HEXISTS', h, 'a')
redis.call('HDEL', h, 'a')
redis.call('XADD', s, 'MAXLEN', '~', 10, '1-0', 'k', 'x')
redis.call('XRANGE', s, '1-0', '+', 'COUNT', 1)
redis.call('DEL', h, s)
redis.call('UNLINK', h, s)
return 1
"""


@dataclass(frozen=True)
class Script:
    """A Lua script and its SHA1 (what EVALSHA names it by)."""

    name: str
    source: bytes
    sha: str


def _script(name: str, source: str) -> Script:
    body = source.encode()
    return Script(name, body, hashlib.sha1(body).hexdigest())


SCRIPTS = {
    name: _script(name, source)
    for name, source in {
        "sync": SYNC,
        "commit": COMMIT,
        "delete": DELETE,
        "clear": CLEAR,
        "budget": BUDGET,
        "probe": PROBE,
    }.items()
}
