-- The listing routes the console reads (controller/src/store/list.rs).
-- A tenant's page of sandboxes is a range of this index in id order (keyset
-- paging), and its counts read only the tenant's rows.
CREATE INDEX sandboxes_tenant_id ON sandboxes (tenant, id);
-- The operations page: recent failures and retries (with their errors), and
-- the number failed, without reading every succeeded operation.
CREATE INDEX operations_erred ON operations (created_at)
    WHERE last_error IS NOT NULL AND state IN ('failed', 'queued');
CREATE INDEX operations_failed ON operations (tenant) WHERE state = 'failed';
