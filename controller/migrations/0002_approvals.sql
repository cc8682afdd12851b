-- Approved proposals (issue 27): a rule a gateway proposed from a sandbox's
-- denials, added to the allow list of every sandbox the scope reaches.

CREATE TABLE approvals (
    id          text PRIMARY KEY,
    tenant      text NOT NULL,
    -- 'sandbox', 'template' or 'tenant'; target is that sandbox's id, that
    -- template's id (within the tenant) or the tenant's id.
    scope       text NOT NULL,
    target      text NOT NULL,
    -- The allow entry, as the policy schema writes it.
    rule        jsonb NOT NULL,
    -- Who approved: the token's principal from the tenants file.
    principal   text NOT NULL,
    approved_at timestamptz NOT NULL DEFAULT now(),
    -- NULL: until revoked.
    until       timestamptz,
    revoked_at  timestamptz,
    -- When the rule was taken out again (revoked, or expired and removed by
    -- the dispatcher); NULL while it is in force.
    removed_at  timestamptz,
    -- The proposal approved: reasons, counts, first/last seen, examples.
    evidence    jsonb NOT NULL,
    CONSTRAINT approval_scope_known CHECK (scope IN ('sandbox', 'template', 'tenant'))
);

CREATE INDEX approvals_in_force ON approvals (tenant) WHERE removed_at IS NULL;
CREATE INDEX approvals_expiring ON approvals (until) WHERE removed_at IS NULL AND until IS NOT NULL;
