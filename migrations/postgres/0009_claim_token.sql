-- Each claim statement writes a token of its own on the runs it leases, so
-- a host whose claim (or close that claims) lost its reply can find the
-- runs that statement took and hand them back, rather than leave them
-- leased to nobody until their leases expire. Unindexed: the hand-back
-- reads the in-flight range of the claim index.
ALTER TABLE runs ADD COLUMN claim_token bigint;
