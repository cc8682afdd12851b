-- A worker's live sandboxes with a policy, by id (store::WORKER_SANDBOXES:
-- every resync and every drift check), found without reading its ended
-- rows, which are kept (their ids stay taken) and so grow with every
-- sandbox the worker ever ran, nor other workers' sandboxes. The predicate
-- is the query's, word for word, so that the planner can prove the index
-- covers it. Built in the migration's transaction, not CONCURRENTLY: a
-- replica starting meanwhile waits for sqlx's migration lock inside a
-- statement, whose snapshot a concurrent build would wait for in turn
-- (a deadlock that leaves an invalid index). Writes to `sandboxes` wait
-- while it builds: 0.23 s for a million rows, a fifth of them live, on a
-- two-core test machine.
CREATE INDEX IF NOT EXISTS sandboxes_worker_live ON sandboxes (worker, id)
    WHERE policy IS NOT NULL AND state NOT IN ('failed', 'destroyed');
