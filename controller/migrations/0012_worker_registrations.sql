-- How many times a worker was registered (PUT /v1/workers/{id}). A resync
-- clears `needs_resync` only if no registration came after the row it
-- resynced from was read (store::worker_seen): one during the resync (a
-- gateway moved to another address, say) raised the flag for a gateway
-- the resync may not have reached, and keeps it raised.
ALTER TABLE workers ADD COLUMN IF NOT EXISTS registrations bigint NOT NULL DEFAULT 0;
