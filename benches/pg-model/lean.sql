-- A lean queue: a small `queue` row per claimable run holds the lease and
-- fence; claiming updates it, closing deletes it (guarded by id and owner)
-- and writes the run row once, with its thread counter and event.
WITH q AS (DELETE FROM queue WHERE run_id = ANY (:ids::bigint[]) AND owner = 'c' || :client_id RETURNING run_id, fence),
r AS (UPDATE runs SET status = 'completed', output = '{}', fence = q.fence, attempt = attempt + 1, started_at = 0,
  finished_at = (extract(epoch from now()) * 1000)::bigint, updated_at = (extract(epoch from now()) * 1000)::bigint
  FROM q WHERE runs.id = q.run_id AND runs.status = 'queued' RETURNING id, runs.fence, thread_id),
t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, 1 FROM r ORDER BY thread_id
  ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + excluded.last_seq RETURNING id, last_seq),
e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at)
  SELECT r.thread_id, t.last_seq, r.id, r.fence, 'message', '{"output":{}}', 0 FROM r JOIN t ON t.id = r.thread_id),
c AS (SELECT run_id FROM queue WHERE COALESCE(lease_expires_at + 1, eligible_at) <= (extract(epoch from now()) * 1000)::bigint
  AND NOT (run_id = ANY (ARRAY(SELECT run_id FROM q)))
  ORDER BY COALESCE(lease_expires_at + 1, eligible_at), run_id LIMIT :batch FOR UPDATE SKIP LOCKED),
n AS (UPDATE queue SET owner = 'c' || :client_id, fence = fence + 1, lease_expires_at = (extract(epoch from now()) * 1000)::bigint + 30000
  FROM c WHERE queue.run_id = c.run_id RETURNING queue.run_id)
SELECT COALESCE(array_agg(run_id), '{}')::text AS ids FROM n
\gset
