-- Wake the leading dispatcher when there is work, instead of waiting for its
-- poll: a queued operation, or a sandbox whose policy moved a generation
-- (a replacement, an approval, a lifecycle change). PostgreSQL delivers the
-- notification when the transaction commits, so what woke the dispatcher is
-- already visible to it, and folds identical notifications of one
-- transaction into one.
CREATE FUNCTION egress_work_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('egress_work', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER operations_queued
    AFTER INSERT ON operations
    FOR EACH STATEMENT EXECUTE FUNCTION egress_work_notify();

CREATE TRIGGER sandboxes_moved
    AFTER UPDATE OF generation ON sandboxes
    FOR EACH ROW WHEN (NEW.generation > OLD.generation)
    EXECUTE FUNCTION egress_work_notify();
