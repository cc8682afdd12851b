-- Shadow policies (docs/controller.md, "Shadows"): a candidate judged beside
-- a sandbox's policy on its worker's gateway, never enforced. The store
-- keeps the candidate as it was given, so a promotion replaces the policy
-- with it like `PUT …/network` does, and knows which sandboxes carry which.
-- (0002 is another change's number.)

CREATE TABLE template_shadows (
    template    text PRIMARY KEY REFERENCES templates (id),
    -- The candidate default (the gateway's format), composed per sandbox.
    policy      jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sandbox_shadows (
    sandbox     text PRIMARY KEY REFERENCES sandboxes (id),
    -- The candidate as given (a tenant policy, or the template's candidate
    -- for a rollout), not composed: it is composed when it is put.
    policy      jsonb NOT NULL,
    -- Set when a template rollout put it; its rows go with the rollout.
    template    text REFERENCES template_shadows (template) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX sandbox_shadows_template ON sandbox_shadows (template) WHERE template IS NOT NULL;
