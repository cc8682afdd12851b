-- A tenant's live sandboxes, counted at every create, fork and claim
-- (max_sandboxes in the tenants file), without reading its destroyed ones.
CREATE INDEX sandboxes_tenant_live ON sandboxes (tenant)
    WHERE state NOT IN ('destroyed', 'failed');
