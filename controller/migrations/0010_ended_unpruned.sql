-- The ended sandboxes whose policy the prune still has to drop (store::prune,
-- every second on the leader): found without scanning every ended row ever,
-- and small, since a row leaves it once pruned.
CREATE INDEX sandboxes_ended_unpruned ON sandboxes (changed_at)
    WHERE state IN ('destroyed', 'failed') AND (policy IS NOT NULL OR provenance <> '[]'::jsonb);
