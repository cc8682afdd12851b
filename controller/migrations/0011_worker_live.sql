-- no-transaction
-- A worker's live sandboxes with a policy, by id (store::WORKER_SANDBOXES:
-- every resync and every drift check), found without reading its ended
-- rows, which are kept (their ids stay taken) and so grow with every
-- sandbox the worker ever ran, nor other workers' sandboxes. The predicate
-- is the query's, word for word, so that the planner can prove the index
-- covers it. Built CONCURRENTLY, outside a transaction and so alone in its
-- file (docs/operations.md, "Migrations with old and new replicas running
-- together"): creates and pushes go on while it builds. A build that was
-- interrupted leaves an invalid index, which IF NOT EXISTS then keeps:
-- `REINDEX INDEX CONCURRENTLY sandboxes_worker_live` repairs it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS sandboxes_worker_live ON sandboxes (worker, id)
    WHERE policy IS NOT NULL AND state NOT IN ('failed', 'destroyed');
