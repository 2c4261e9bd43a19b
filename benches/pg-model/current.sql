-- Today's data model: the run row is the queue entry. One statement per
-- batch: close this client's runs of the last batch (guarded by id, owner
-- and status; each bumps its thread's counter and writes its `message`
-- event), then claim :batch more through leasehold_claimable, as the
-- host's close batch does. Passes the claimed ids on in :ids.
WITH r AS (UPDATE runs SET status = 'completed', output = '{}', error = NULL, lease_owner = NULL, lease_expires_at = NULL,
  finished_at = (extract(epoch from now()) * 1000)::bigint, updated_at = (extract(epoch from now()) * 1000)::bigint
  WHERE id = ANY (:ids::bigint[]) AND lease_owner = 'c' || :client_id AND status = 'running' RETURNING id, fence, thread_id),
t AS (INSERT INTO threads (id, last_seq) SELECT thread_id, 1 FROM r ORDER BY thread_id
  ON CONFLICT (id) DO UPDATE SET last_seq = threads.last_seq + excluded.last_seq RETURNING id, last_seq),
e AS (INSERT INTO events (thread_id, seq, run_id, fence, kind, payload, created_at)
  SELECT r.thread_id, t.last_seq, r.id, r.fence, 'message', '{"output":{}}', 0 FROM r JOIN t ON t.id = r.thread_id),
c AS (SELECT f.id FROM leasehold_claimable(:batch, ARRAY(SELECT id FROM r)) AS f(id)),
n AS (UPDATE runs SET status = 'running', lease_owner = 'c' || :client_id, fence = fence + 1, attempt = attempt + 1,
  lease_expires_at = (extract(epoch from now()) * 1000)::bigint + 30000, heartbeat_at = (extract(epoch from now()) * 1000)::bigint,
  updated_at = (extract(epoch from now()) * 1000)::bigint, started_at = COALESCE(started_at, (extract(epoch from now()) * 1000)::bigint)
  FROM c WHERE runs.id = c.id RETURNING runs.id)
SELECT COALESCE(array_agg(id), '{}')::text AS ids FROM n
\gset
