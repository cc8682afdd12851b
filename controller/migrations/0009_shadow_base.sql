-- The sandbox's saved effective policy when its shadow was put: a promotion
-- is refused (409) when the sandbox's policy has changed since (a
-- replacement, an approval), since the shadow's report never judged that
-- change and promoting would undo it. NULL (a shadow put before this
-- column) is refused the same way: put it again.
ALTER TABLE sandbox_shadows ADD COLUMN base jsonb;
