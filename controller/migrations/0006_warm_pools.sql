-- Warm pools (docs/controller.md, "Warm pools"): a template may keep sandboxes
-- created ahead of time, placed and pushed with the template's policy, for a
-- create that names the pool to claim. (0005 is another change's number.)

CREATE TABLE template_pools (
    template    text PRIMARY KEY REFERENCES templates (id),
    -- How many unclaimed sandboxes the dispatcher keeps (creating or ready).
    size        integer NOT NULL CHECK (size >= 0 AND size <= 10000),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The pool a sandbox waits in (its template); NULL once claimed, and for
-- every sandbox that was never pooled. A pooled sandbox's tenant is ''.
ALTER TABLE sandboxes ADD COLUMN warm_pool text;

CREATE INDEX sandboxes_warm ON sandboxes (warm_pool, created_at) WHERE warm_pool IS NOT NULL;
