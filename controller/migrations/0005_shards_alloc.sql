-- The controller at fleet scale (issue 30). Only additions: replicas of the
-- previous build keep running beside these through a rolling upgrade.

-- Dispatchers share the workers. Each worker belongs to one of 64 shards
-- (a hash of its id); each shard is leased to one running dispatcher at a
-- time, which alone executes the operations that name its workers and
-- pushes to their gateways. A dispatcher renews its heartbeat and its
-- leases every third of the lease; a lease not renewed expires and another
-- dispatcher takes the shard over. The shares are rebalanced as
-- dispatchers come and go (docs/controller.md, "The dispatcher").
CREATE TABLE dispatchers (
    id         text PRIMARY KEY,
    -- Alive while this is in the future.
    expires    timestamptz NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE dispatcher_shards (
    shard     integer PRIMARY KEY,
    -- The dispatcher holding the lease, until `expires`; NULL: released.
    holder    text,
    expires   timestamptz NOT NULL DEFAULT '-infinity',
    -- How many times the shard changed hands.
    handovers bigint NOT NULL DEFAULT 0
);

INSERT INTO dispatcher_shards (shard) SELECT generate_series(0, 63);

CREATE FUNCTION egress_worker_shard(worker text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT (hashtext(worker) & 2147483647) % 64 $$;

-- The generation the worker's gateway reported (GET /readyz) when the store
-- last knew it to hold exactly the store's view, plus the pushes it applied
-- since. A gateway reporting this generation and the epoch last seen is in
-- step: its list is compared only when they differ. NULL: unknown.
ALTER TABLE workers ADD COLUMN acked_generation bigint;

-- Address allocation in O(1): the addresses live sandboxes hold, the
-- addresses released since (reused lowest first), and per worker a cursor
-- over its pool's hosts never handed out, with the count of its live
-- sandboxes (placement picks the least loaded). A trigger keeps them from
-- the sandboxes' own rows, whichever build writes them; the primary key
-- makes handing out one address twice impossible.
CREATE TABLE address_allocations (
    worker  text NOT NULL,
    address inet NOT NULL,
    sandbox text NOT NULL,
    PRIMARY KEY (worker, address)
);

CREATE INDEX address_allocations_sandbox ON address_allocations (sandbox);

CREATE TABLE address_free (
    worker  text NOT NULL,
    address inet NOT NULL,
    PRIMARY KEY (worker, address)
);

CREATE TABLE address_cursors (
    worker text PRIMARY KEY,
    -- The pool `next` walks (a changed pool starts a new walk); NULL: none yet.
    pool   text,
    -- The offset, among the pool's hosts, of the next one never handed out.
    next   bigint NOT NULL DEFAULT 0,
    -- Sandboxes on the worker that are neither destroyed nor failed.
    live   bigint NOT NULL DEFAULT 0
);

CREATE FUNCTION egress_addresses_track() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    was_live boolean := TG_OP = 'UPDATE' AND OLD.worker IS NOT NULL
        AND OLD.state NOT IN ('destroyed', 'failed');
    is_live boolean := NEW.worker IS NOT NULL AND NEW.state NOT IN ('destroyed', 'failed');
BEGIN
    IF TG_OP = 'UPDATE' AND was_live = is_live AND OLD.worker IS NOT DISTINCT FROM NEW.worker
        AND OLD.addresses IS NOT DISTINCT FROM NEW.addresses THEN
        RETURN NULL;
    END IF;
    IF was_live THEN
        DELETE FROM address_allocations WHERE worker = OLD.worker AND sandbox = OLD.id;
        INSERT INTO address_free (worker, address)
            SELECT OLD.worker, a::inet FROM unnest(OLD.addresses) AS a
            ON CONFLICT DO NOTHING;
        UPDATE address_cursors SET live = live - 1 WHERE worker = OLD.worker;
    END IF;
    IF is_live THEN
        DELETE FROM address_free WHERE worker = NEW.worker AND address = ANY (NEW.addresses::inet[]);
        -- Another live sandbox holding one of these is a unique violation.
        INSERT INTO address_allocations (worker, address, sandbox)
            SELECT NEW.worker, a::inet, NEW.id FROM unnest(NEW.addresses) AS a;
        INSERT INTO address_cursors (worker, live) VALUES (NEW.worker, 1)
            ON CONFLICT (worker) DO UPDATE SET live = address_cursors.live + 1;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER sandboxes_addresses
    AFTER INSERT OR UPDATE OF state, worker, addresses ON sandboxes
    FOR EACH ROW EXECUTE FUNCTION egress_addresses_track();

-- What the trigger would have recorded for the sandboxes already there.
INSERT INTO address_cursors (worker, live)
    SELECT w.id, (SELECT count(*) FROM sandboxes s
                  WHERE s.worker = w.id AND s.state NOT IN ('destroyed', 'failed'))
    FROM workers w;
INSERT INTO address_allocations (worker, address, sandbox)
    SELECT s.worker, a::inet, s.id FROM sandboxes s, unnest(s.addresses) AS a
    WHERE s.worker IS NOT NULL AND s.state NOT IN ('destroyed', 'failed')
    ON CONFLICT DO NOTHING;

-- Pruning (the dispatcher's --operation-retention, --idempotency-retention).
CREATE INDEX operations_finished ON operations (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX operations_keyed ON operations (created_at) WHERE idempotency_key IS NOT NULL;
