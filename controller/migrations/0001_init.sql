-- The controller's store. Profile *definitions* are never stored: a sandbox
-- keeps the names it selected, resolved against the running configuration.

CREATE TABLE templates (
    id          text PRIMARY KEY,
    -- The template's default effective policy (JSON, the gateway's format).
    policy      jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workers (
    id          text PRIMARY KEY,
    -- The worker gateway's admin API, and its bearer token ('' = none).
    admin_url   text NOT NULL,
    token       text NOT NULL,
    -- The CIDR sandbox addresses on this worker are allocated from.
    pool        text NOT NULL,
    -- The epoch the gateway last reported: a new one means it restarted.
    epoch       text,
    -- Set when the gateway needs a full resync (restart, drift, new worker).
    needs_resync boolean NOT NULL DEFAULT true,
    last_error  text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sandboxes (
    id                text PRIMARY KEY,
    tenant            text NOT NULL,
    template          text NOT NULL REFERENCES templates (id),
    -- The selected names; an explicit empty array is a value, never NULL.
    egress_profiles   text[] NOT NULL,
    -- The saved effective policy; NULL until a queued create has run.
    policy            jsonb,
    -- True while the sandbox runs its template's policy without an override.
    inherits_template boolean NOT NULL,
    -- Which profile or deployment setting added which rule.
    provenance        jsonb NOT NULL DEFAULT '[]',
    state             text NOT NULL,
    worker            text REFERENCES workers (id),
    addresses         text[] NOT NULL DEFAULT '{}',
    -- Bumped by every change the worker's gateway must see; pushed_generation
    -- trails it until the push is acknowledged.
    generation        bigint NOT NULL DEFAULT 0,
    pushed_generation bigint NOT NULL DEFAULT 0,
    changed_at        timestamptz NOT NULL DEFAULT now(),
    created_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT state_known CHECK (state IN
        ('creating', 'running', 'stopped', 'paused', 'suspended', 'failed', 'destroyed'))
);

CREATE INDEX sandboxes_unpushed ON sandboxes (worker) WHERE generation > pushed_generation;

CREATE TABLE operations (
    id              text PRIMARY KEY,
    tenant          text NOT NULL,
    kind            text NOT NULL,
    sandbox         text NOT NULL REFERENCES sandboxes (id),
    payload         jsonb NOT NULL,
    state           text NOT NULL DEFAULT 'queued',
    attempts        integer NOT NULL DEFAULT 0,
    not_before      timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    idempotency_key text,
    fingerprint     text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    CONSTRAINT op_state_known CHECK (state IN ('queued', 'running', 'succeeded', 'failed')),
    CONSTRAINT one_key_per_tenant UNIQUE (tenant, idempotency_key)
);

CREATE INDEX operations_ready ON operations (not_before) WHERE state = 'queued';
