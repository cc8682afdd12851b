-- How many times a worker was registered (PUT /v1/workers/{id}). A resync
-- clears `needs_resync` only if no registration came after the row it
-- resynced from was read (store::worker_seen): one during the resync (a
-- gateway moved to another address, say) raised the flag for a gateway
-- the resync may not have reached, and keeps it raised.
ALTER TABLE workers ADD COLUMN IF NOT EXISTS registrations bigint NOT NULL DEFAULT 0;

-- A registration by a build before this column (a replica not yet upgraded
-- in a rolling upgrade) does not count itself: any change of a worker's
-- gateway, its token or its address pool is counted here too, whoever
-- writes it. Once only: a registration that counted itself is not
-- counted twice.
CREATE OR REPLACE FUNCTION egress_worker_registered() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (NEW.admin_url, NEW.token, NEW.pool) IS DISTINCT FROM (OLD.admin_url, OLD.token, OLD.pool) THEN
        NEW.registrations := GREATEST(NEW.registrations, OLD.registrations + 1);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER workers_registered
    BEFORE UPDATE ON workers
    FOR EACH ROW EXECUTE FUNCTION egress_worker_registered();
