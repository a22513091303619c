//! The two Lua scripts the Redis store runs. Each runs atomically inside Redis (no other
//! command interleaves), which is what makes the per-key rules hold across replicas: the
//! check of the stored record and the write of the new one are one step.
//!
//! Numbers in the JSON records are decoded by Redis's `cjson` as doubles: exact up to 2^53,
//! far above any version (epoch milliseconds or a count of changes) or token count the
//! ledger produces. The only number re-encoded here (the carry record's) is formatted with
//! `%.0f`, so it is written back as the integer it is.

/// Put a batch of records, in order. `KEYS[1]` the holds hash, `KEYS[2]` the settled sorted
/// set, `KEYS[3]` the lease's epoch; `ARGV[1]` the generated-key prefix, `ARGV[2]` the carry
/// prefix, `ARGV[3]` the writer's hold owner (empty: no fencing), `ARGV[4]` the lease epoch
/// it leads under (0: it does not lead), then pairs of (key, record JSON).
///
/// Fencing first: a record of another owner's hold (N's `owner` is not the writer) is refused
/// unless the writer leads under the lease's current epoch: a deposed leader, paused or cut
/// off past its lease, cannot expire or overwrite what the new leader now owns. Then, for a
/// stored record S and a new one N of the same key:
///
/// - S absent (or unreadable): write N.
/// - the same hold (same `attempt`, `created_at_ms` and `owner`): an old `held` (version not above
///   S's) is a replay: skip it. Else, if S is terminal (done, cancelled, expired, rejected)
///   and N's state differs, refuse: a conflict, the first terminal state wins (a deposed
///   leader's late `done` after the new leader's `expired`, whatever their versions).
///   Otherwise write N if its version is higher, else skip it (stale or replayed).
/// - a new hold of the key: if S is done, or held and not yet expired when N was placed
///   (`expires_at_ms` at or before N's `created_at_ms`: a hold whose replica died, which no
///   leader knew, must not lock its key out for ever), refuse: a conflict (a key is held or
///   done once across all replicas). Otherwise write N if its version is higher, else skip.
///
/// Written settled records
/// go into the sorted set (score: `updated_at_ms`, or -1 for generated keys, prunable at
/// once); a written held record leaves it.
///
/// Returns `{written, stale, terminal conflicts, held conflicts, first terminal conflict key,
/// first held conflict key, unreadable new records, refused holds, fenced}`, refused holds a
/// flat list of (key, `created_at_ms`) of every new `held` record refused: the store tells the
/// request that placed such a hold that its key is a duplicate before it goes upstream.
pub(super) const PUT: &str = r#"
local holds, settled = KEYS[1], KEYS[2]
local gen, carry = ARGV[1], ARGV[2]
local writer, wepoch = ARGV[3], tonumber(ARGV[4]) or 0
local leads = wepoch > 0 and wepoch == (tonumber(redis.call('GET', KEYS[3]) or '0') or 0)
local fenced = 0
local terminal = {done = true, cancelled = true, expired = true, rejected = true}
local function decode(raw)
  if not raw then return nil end
  local ok, v = pcall(cjson.decode, raw)
  if ok and type(v) == 'table' and type(v.version) == 'number'
      and type(v.attempt) == 'number' and type(v.created_at_ms) == 'number'
      and type(v.updated_at_ms) == 'number' and type(v.state) == 'string' then
    return v
  end
  return nil
end
local written, stale, c_term, c_held, bad = 0, 0, 0, 0, 0
local first_term, first_held = '', ''
local refused = {}
for i = 5, #ARGV - 1, 2 do
  local key, raw = ARGV[i], ARGV[i + 1]
  local n = decode(raw)
  if n == nil then
    bad = bad + 1
  elseif writer ~= '' and n.owner ~= writer and not leads then
    fenced = fenced + 1
  else
    local s = decode(redis.call('HGET', holds, key))
    local verdict = 'write'
    if s ~= nil then
      if s.attempt == n.attempt and s.created_at_ms == n.created_at_ms
          and s.owner == n.owner then
        if n.version <= s.version and not terminal[n.state] then
          verdict = 'stale'
        elseif terminal[s.state] and n.state ~= s.state then
          verdict = 'term'
        elseif n.version <= s.version then
          verdict = 'stale'
        end
      elseif s.state == 'done' or (s.state == 'held' and not (
          type(s.expires_at_ms) == 'number' and type(n.created_at_ms) == 'number'
          and s.expires_at_ms <= n.created_at_ms)) then
        verdict = 'held'
      elseif n.version <= s.version then
        verdict = 'stale'
      end
    end
    if verdict == 'write' then
      redis.call('HSET', holds, key, raw)
      if n.state == 'held' then
        redis.call('ZREM', settled, key)
      elseif string.sub(key, 1, #carry) ~= carry then
        local score = n.updated_at_ms
        if string.sub(key, 1, #gen) == gen then score = -1 end
        redis.call('ZADD', settled, score, key)
      end
      written = written + 1
    elseif verdict == 'stale' then
      stale = stale + 1
    elseif verdict == 'term' then
      c_term = c_term + 1
      if first_term == '' then first_term = key .. ' (' .. s.state .. ', then ' .. n.state .. ')' end
    else
      c_held = c_held + 1
      if first_held == '' then first_held = key .. ' (' .. s.state .. ')' end
      if n.state == 'held' then
        refused[#refused + 1] = key
        refused[#refused + 1] = string.format('%.0f', n.created_at_ms)
      end
    end
  end
end
return {written, stale, c_term, c_held, first_term, first_held, bad, refused, fenced}
"#;

/// Prune one batch of settled keys. `KEYS[1]` the holds hash, `KEYS[2]` the settled sorted
/// set; `ARGV[1]` the horizon (prune scores below it), `ARGV[2]` the batch size, `ARGV[3]` now
/// (epoch ms), `ARGV[4]` the carry prefix. Each pruned record's tokens (its own and its
/// earlier holds') are folded into its tenant's carry record `<carry prefix><tenant>` (state
/// done, never pruned), in the same script, so tenant totals after a restore are unchanged.
/// Returns `{pruned, examined}`: call again while `examined` equals the batch size.
pub(super) const PRUNE: &str = r#"
local holds, settled = KEYS[1], KEYS[2]
local horizon, batch, now, carry = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local keys = redis.call('ZRANGEBYSCORE', settled, '-inf', '(' .. horizon, 'LIMIT', 0, batch)
local sums, tenants = {}, {}
local pruned = 0
for _, key in ipairs(keys) do
  local raw = redis.call('HGET', holds, key)
  local ok, s = false, nil
  if raw then ok, s = pcall(cjson.decode, raw) end
  redis.call('ZREM', settled, key)
  if ok and type(s) == 'table' and type(s.state) == 'string' and s.state ~= 'held' then
    local tenant = s.tenant
    if type(tenant) ~= 'string' then tenant = nil end
    local slot = tenant or '\0none'
    if sums[slot] == nil then
      sums[slot] = {0, 0}
      tenants[slot] = tenant
    end
    local function num(v) if type(v) == 'number' then return v end return 0 end
    sums[slot][1] = sums[slot][1] + num(s.tokens_spent) + num(s.prior_spent)
    sums[slot][2] = sums[slot][2] + num(s.tokens_wasted) + num(s.prior_wasted)
    redis.call('HDEL', holds, key)
    pruned = pruned + 1
  end
end
for slot, sum in pairs(sums) do
  local tenant = tenants[slot]
  local ckey = carry .. (tenant or '')
  local spent, wasted, version, created = sum[1], sum[2], 0, now
  local okc, c = pcall(cjson.decode, redis.call('HGET', holds, ckey) or '')
  if okc and type(c) == 'table' then
    if type(c.tokens_spent) == 'number' then spent = spent + c.tokens_spent end
    if type(c.tokens_wasted) == 'number' then wasted = wasted + c.tokens_wasted end
    if type(c.version) == 'number' then version = c.version end
    if type(c.created_at_ms) == 'number' then created = c.created_at_ms end
  end
  local function int(v) return string.format('%.0f', v) end
  local tjson = 'null'
  if tenant then tjson = cjson.encode(tenant) end
  local rec = '{"key":' .. cjson.encode(ckey) .. ',"tenant":' .. tjson ..
    ',"state":"done","attempt":0,"tokens_held":0,"tokens_spent":' .. int(spent) ..
    ',"tokens_wasted":' .. int(wasted) .. ',"created_at_ms":' .. int(created) ..
    ',"expires_at_ms":' .. int(now) .. ',"updated_at_ms":' .. int(now) ..
    ',"version":' .. int(version + 1) ..
    ',"prior_spent":0,"prior_wasted":0,"reservation":false}'
  redis.call('HSET', holds, ckey, rec)
end
return {pruned, #keys}
"#;
