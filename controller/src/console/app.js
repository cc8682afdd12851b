// The operator console (docs/console.md). Every datum is a call to the JSON
// API with the bearer token the operator typed, kept in this tab's
// sessionStorage and sent in the Authorization header (never a cookie).
// Text is always set with textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "egress-console-token";
const POLL_MS = 3000;
const REASONS = "/console/reason-codes.md";
let timers = [];
// Bumped by every navigation: a page whose answers come back after the
// operator moved on draws nothing.
let generation = 0;
// Proposals approved from this tab (proposal id -> approval id), so a
// refresh of the list keeps saying so.
const approved = new Map();
// Sandboxes whose shadow was promoted from this tab.
const promoted = new Set();

// === the API ===

function token() { return sessionStorage.getItem(TOKEN_KEY); }

async function api(method, path, body) {
  const headers = { "Authorization": "Bearer " + token() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const init = { method, headers, cache: "no-store", credentials: "omit" };
  if (body !== undefined) init.body = JSON.stringify(body);
  let resp;
  try { resp = await fetch(path, init); }
  catch (e) { return { status: 0, body: { error: "the API cannot be reached: " + e.message } }; }
  let data = null;
  try { data = await resp.json(); } catch (e) { data = { error: "not JSON (" + resp.status + ")" }; }
  // A token the API no longer takes: back to the login, and every poll of
  // the page stops (route clears them) instead of going on without one.
  if (resp.status === 401 && token() !== null) {
    sessionStorage.removeItem(TOKEN_KEY);
    setTimeout(route, 0);
  }
  return { status: resp.status, body: data };
}

// === building the page ===

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function table(headings, rows, empty) {
  if (!rows.length) return el("p", { class: "note" }, empty);
  return el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, headings.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows)));
}

function tag(word, kind) { return el("span", { class: "tag " + (kind || "") }, word); }

function verdictTag(v) { return tag(v, v === "deny" ? "bad" : v === "allow" ? "good" : ""); }

function reasonLink(code) {
  return el("a", { href: "#reasons/" + encodeURIComponent(code), class: "mono" }, code);
}

function message(text, bad) {
  return el("div", { class: "message" + (bad ? " bad" : ""), role: bad ? "alert" : "status" }, text);
}

function failure(r) { return message((r.body && r.body.error) || ("HTTP " + r.status), true); }

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
}

function every(ms, fn) { fn(); timers.push(setInterval(fn, ms)); }

function clock() { return new Date().toLocaleTimeString([], { hour12: false }); }

function destText(d) {
  if (!d || typeof d !== "object") return String(d);
  const keys = ["domain", "wildcard_domain", "cidr", "ip", "address"];
  const name = keys.filter((k) => d[k] !== undefined).map((k) => k + " " + d[k]);
  const rest = Object.keys(d).filter((k) => !keys.includes(k)).map((k) => k + "=" + JSON.stringify(d[k]));
  return name.concat(rest).join(", ");
}

// === login ===

function login(then) {
  document.getElementById("logout").hidden = true;
  const input = el("input", { type: "password", id: "token", autocomplete: "off", required: true });
  const form = el("form", { class: "bar", onsubmit: (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    const target = then || "#sandboxes";
    if (location.hash === target) route(); else location.hash = target;
  } }, el("label", {}, "API token", input), el("button", { type: "submit", class: "primary" }, "Log in"));
  show(el("h1", {}, "Log in"),
    el("p", {}, "The token is one of the API's bearer tokens. It stays in this browser tab only."),
    form);
  input.focus();
}

// === sandboxes ===

function params(query) { return new URLSearchParams(query || ""); }

async function sandboxes(query) {
  const q = params(query);
  const fields = ["tenant", "state", "worker", "profile"];
  const inputs = {};
  for (const f of fields) inputs[f] = el("input", { name: f, id: "filter-" + f, value: q.get(f) || "" });
  inputs.state = el("select", { name: "state", id: "filter-state" },
    ["", "creating", "running", "stopped", "paused", "suspended", "failed", "destroyed"].map((s) =>
      el("option", { value: s, selected: (q.get("state") || "") === s }, s || "any")));
  const form = el("form", { class: "bar", role: "search", onsubmit: (ev) => {
    ev.preventDefault();
    const next = new URLSearchParams();
    for (const f of fields) if (inputs[f].value) next.set(f, inputs[f].value);
    location.hash = "#sandboxes?" + next.toString();
  } }, fields.map((f) => el("label", {}, f, inputs[f])), el("button", { type: "submit" }, "Filter"));
  show(el("h1", {}, "Sandboxes"), form, el("p", { class: "note" }, "Loading…"));
  const g = generation;
  const r = await api("GET", "/v1/sandboxes?" + q.toString());
  if (g !== generation) return;
  if (r.status !== 200) return show(el("h1", {}, "Sandboxes"), form, failure(r));
  const c = r.body.counts;
  const counts = el("div", { class: "counts", id: "counts" },
    el("strong", {}, c.total + " sandboxes"),
    Object.entries(c.by_state).map(([s, n]) => el("span", {}, s + ": " + n)));
  const rows = r.body.sandboxes.map((s) => el("tr", {},
    el("td", { class: "mono" }, el("a", { href: "#sandbox/" + encodeURIComponent(s.id) }, s.id)),
    el("td", {}, s.tenant), el("td", {}, tag(s.state)), el("td", {}, s.worker || "—"),
    el("td", {}, s.template), el("td", {}, s.egress_profiles.join(", ") || "—"),
    el("td", {}, s.pushed ? "pushed" : "push pending")));
  show(el("h1", {}, "Sandboxes"), form, counts,
    table(["Sandbox", "Tenant", "State", "Worker", "Template", "Profiles", "Gateway"], rows,
      "No sandbox matches."),
    pager(q, r.body.next));
}

function pager(q, next) {
  const links = [];
  if (q.get("after")) {
    const first = new URLSearchParams(q); first.delete("after");
    links.push(el("a", { href: "#sandboxes?" + first.toString() }, "First page"));
  }
  if (next) {
    const n = new URLSearchParams(q); n.set("after", next);
    links.push(el("a", { href: "#sandboxes?" + n.toString(), id: "next-page" }, "Next page"));
  }
  return el("div", { class: "pager" }, links);
}

// === one sandbox ===

function same(a, b) { return JSON.stringify(sorted(a)) === JSON.stringify(sorted(b)); }

function sorted(v) {
  if (Array.isArray(v)) return v.map(sorted);
  if (v && typeof v === "object") {
    return Object.keys(v).sort().reduce((o, k) => { o[k] = sorted(v[k]); return o; }, {});
  }
  return v;
}

// Composition adds an allow that is exactly a destination: a rule with a
// qualifier, streams or an until is never one it added.
function wholeDestination(rule) {
  return !("http" in rule) && !("mode" in rule) && !("streams" in rule) && !("until" in rule);
}

// Where a rule came from: the provenance entry naming it, else the
// tenant's own policy (or the template's, while the sandbox inherits it).
function provenanceOf(list, rule, provenance, inherits) {
  const entry = provenance.find((e) => (e.list || "allow") === list && (e.rule
    ? same(e.rule, rule)
    : (list === "tls_interception_exemptions" || wholeDestination(rule)) && same(e.destination, rule)));
  if (!entry) {
    return inherits ? { source: "template", detail: "the template's policy, inherited" }
      : { source: "tenant", detail: "the sandbox's base policy (its own or its template's)" };
  }
  const s = entry.source;
  if (s === "approval") {
    const bits = ["approval " + entry.approval, "scope " + entry.scope, "by " + entry.principal];
    if (entry.until) bits.push("until " + entry.until);
    return { source: "approval", detail: bits.join(", ") };
  }
  if (s.startsWith("profile:")) return { source: "profile", detail: s.slice(8) };
  if (s === "resolver_allowance") return { source: "resolver allowance", detail: "the sandbox's DNS resolver" };
  if (s === "deployment") return { source: "deployment exemption", detail: "" };
  return { source: s, detail: "" };
}

function policySection(doc) {
  const p = doc.policy;
  if (!p) return el("p", { class: "note" }, "No effective policy yet (the create has not run).");
  const prov = Array.isArray(doc.provenance) ? doc.provenance : [];
  const rows = [];
  for (const list of ["allow", "deny", "tls_interception_exemptions"]) {
    for (const rule of p[list] || []) {
      const o = provenanceOf(list, rule, prov, doc.inherits_template);
      // The whole rule: its qualifiers (http, mode, streams) say what it
      // lets through; shown without them it would read narrower or wider.
      rows.push(el("tr", { "data-list": list },
        el("td", {}, list === "tls_interception_exemptions" ? "exempt from interception" : list),
        el("td", { class: "mono" }, destText(rule)),
        el("td", { class: "provenance" }, tag(o.source)), el("td", {}, o.detail)));
    }
  }
  return el("section", { "aria-labelledby": "h-policy" },
    el("h2", { id: "h-policy" }, "Effective policy"),
    el("p", {}, "Default: ", tag(p.default || "deny"), " · TLS interception: ", tag(p.tls_interception || "off")),
    table(["List", "Rule", "Source", "Provenance"], rows, "No rules: the default decides."));
}

function facts(doc) {
  const pairs = [["Tenant", doc.tenant], ["State", doc.state], ["Worker", doc.worker || "—"],
    ["Template", doc.template + (doc.inherits_template ? " (inherited policy)" : "")],
    ["Profiles", (doc.egress_profiles || []).join(", ") || "—"],
    ["Addresses", (doc.addresses || []).join(", ") || "—"]];
  return el("dl", { class: "facts" }, pairs.map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

async function sandbox(id) {
  const g = generation;
  const r = await api("GET", "/v1/sandboxes/" + encodeURIComponent(id));
  if (g !== generation) return;
  if (r.status !== 200) return show(el("h1", {}, "Sandbox " + id), failure(r));
  const doc = r.body;
  const denials = el("div", { id: "denials" });
  const proposals = el("div", { id: "proposals" });
  const shadow = el("div", { id: "shadow" });
  show(el("h1", {}, "Sandbox " + doc.id), facts(doc), policySection(doc),
    el("section", { "aria-labelledby": "h-denials" },
      el("h2", { id: "h-denials" }, "Recent denials and would-denies"), denials),
    el("section", { "aria-labelledby": "h-proposals" },
      el("h2", { id: "h-proposals" }, "Proposals"), proposals),
    el("section", { "aria-labelledby": "h-shadow" },
      el("h2", { id: "h-shadow" }, "Shadow policy"), shadow),
    explainSection(doc.id));
  every(POLL_MS, () => refreshDenials(doc.id, denials, proposals, shadow));
}

// Refreshed lists are redrawn only when what they show changed, so a
// control the operator has focused (a scope, Approve, Promote) stays.
function redraw(container, signature, build) {
  if (container.dataset.sig === signature) return;
  container.dataset.sig = signature;
  container.replaceChildren(build());
}

async function refreshDenials(id, denials, proposals, shadow) {
  const base = "/v1/sandboxes/" + encodeURIComponent(id);
  const [p, s] = await Promise.all([api("GET", base + "/proposals"), api("GET", base + "/shadow/report")]);
  const list = p.status === 200 ? p.body.proposals || [] : [];
  const report = s.status === 200 ? s.body : null;
  const items = [];
  for (const prop of list) for (const ex of prop.examples || []) items.push([ex, "denied"]);
  for (const d of (report && report.differences) || []) {
    if (d.shadow && d.shadow.verdict === "deny" && d.active.verdict !== "deny") {
      // The example is the flow as the active policy judged it: the
      // reason shown is the shadow's.
      items.push([Object.assign({ dst: destText(d.destination) }, d.example || {},
        { reason: d.shadow.reason, ts: d.last_seen }), "would deny (shadow)"]);
    }
  }
  items.sort((a, b) => (b[0].ts || "").localeCompare(a[0].ts || ""));
  const [shown, updated] = denials.children.length === 2 ? denials.children
    : [el("div", {}), el("p", { class: "note" })];
  if (denials.children.length !== 2) denials.replaceChildren(shown, updated);
  redraw(shown, JSON.stringify([p.status, items]), () =>
    p.status === 200 || p.status === 404 ? table(["Time", "Verdict", "Destination", "Name", "Request", "Reason"],
      items.slice(0, 50).map(([ex, verdict]) => denialRow(ex, verdict)), "No denials recorded.") : failure(p));
  updated.textContent = "Updated " + clock() + "; refreshes every " + POLL_MS / 1000 + " s.";
  // Rows keep their place (first seen first), and the table is rebuilt
  // only when the proposals themselves change, never while a control in it
  // has the focus: a scope picked or Approve focused stays, and a sandbox
  // denied again cannot move a row under the pointer. Counts update in place.
  const ordered = list.slice().sort((a, b) =>
    (a.first_seen || "").localeCompare(b.first_seen || "") || String(a.id).localeCompare(String(b.id)));
  if (!proposals.contains(document.activeElement)) {
    redraw(proposals, JSON.stringify([p.status, ordered.map((x) => [x.id, x.rule, x.reasons])]),
      () => p.status === 200 ? proposalTable(id, ordered) : failure(p));
  }
  for (const prop of ordered) {
    const row = proposals.querySelector("tr[data-row=\"" + CSS.escape(String(prop.id)) + "\"]");
    if (!row) continue;
    row.querySelector(".count").textContent = String(prop.count);
    row.querySelector(".last").textContent = prop.last_seen || "—";
  }
  redraw(shadow, JSON.stringify([s.status, s.body, promoted.has(id)]), () => shadowSection(id, s));
}

function denialRow(ex, verdict) {
  const name = ex.sni || ex.host || (ex.attributed || []).join(", ") || "—";
  const req = ex.method ? ex.method + " " + ex.path : "—";
  return el("tr", {},
    el("td", { class: "mono" }, ex.ts || "—"), el("td", {}, tag(verdict, "bad")),
    el("td", { class: "mono" }, ex.dst || "—"), el("td", { class: "mono" }, name),
    el("td", { class: "mono" }, req), el("td", {}, ex.reason ? reasonLink(ex.reason) : "—"));
}

function proposalTable(id, list) {
  const rows = list.map((prop) => {
    const scope = el("select", { "aria-label": "Scope of the approval of " + prop.id },
      ["sandbox", "template", "tenant"].map((s) => el("option", { value: s }, s)));
    const done = approved.get(id + "/" + prop.id);
    const out = el("span", { role: "status" }, done ? "Approved (" + done + ")" : "");
    const button = el("button", { type: "button", class: "primary approve", "data-proposal": prop.id, disabled: !!done,
      onclick: async () => {
        button.disabled = true;
        const path = "/v1/sandboxes/" + encodeURIComponent(id) + "/proposals/" + encodeURIComponent(prop.id) + "/approve";
        const r = await api("POST", path, { scope: scope.value });
        // 200: the same approval was already in force (approved from another
        // tab, or before a reload).
        const ok = r.status === 201 || r.status === 200;
        if (ok) approved.set(id + "/" + prop.id, r.body.id);
        out.replaceChildren(r.status === 201 ? "Approved (" + r.body.id + ")"
          : r.status === 200 ? "Already approved (" + r.body.id + ")" : failure(r));
        if (!ok) button.disabled = false;
      } }, "Approve");
    return el("tr", { "data-row": prop.id },
      el("td", { class: "mono" }, destText(prop.rule)),
      el("td", { class: "count" }, String(prop.count)),
      el("td", {}, (prop.reasons || []).map((c) => [reasonLink(c), " "])),
      el("td", { class: "mono last" }, prop.last_seen || "—"),
      el("td", {}, scope, " ", button, " ", out));
  });
  return table(["Proposed rule", "Denials", "Reasons", "Last seen", "Approve"], rows, "No proposals.");
}

function shadowSection(id, s) {
  if (s.status === 404) {
    return el("p", { class: "note" },
      (promoted.has(id) ? "Promoted: the candidate is the policy now. " : "") + "No shadow policy.");
  }
  if (s.status === 409) return el("p", { class: "note" }, (s.body && s.body.error) || "Not on a gateway.");
  if (s.status !== 200) return failure(s);
  const out = el("span", { role: "status" });
  const promote = el("button", { type: "button", id: "promote", onclick: async () => {
    promote.disabled = true;
    const r = await api("POST", "/v1/sandboxes/" + encodeURIComponent(id) + "/shadow/promote");
    if (r.status === 200) promoted.add(id);
    out.replaceChildren(r.status === 200 ? "Promoted: the candidate is the policy now." : failure(r));
    if (r.status !== 200) promote.disabled = false;
  } }, "Promote");
  const rows = (s.body.differences || []).map((d) => el("tr", {},
    el("td", { class: "mono" }, destText(d.destination)),
    el("td", {}, verdictTag(d.active.verdict), " ", reasonLink(d.active.reason)),
    el("td", {}, d.shadow === "unobservable" ? "unobservable" : [verdictTag(d.shadow.verdict), " ", reasonLink(d.shadow.reason)]),
    el("td", {}, String(d.count)), el("td", { class: "mono" }, d.last_seen)));
  const evicted = s.body.evicted || 0;
  return el("div", {},
    el("p", {}, "Since " + (s.body.counting_since || s.body.since) + ": " + s.body.flows + " flows, " + s.body.requests + " requests judged again."),
    evicted > 0 ? el("p", { class: "note" }, evicted + " differences were dropped to keep the report bounded: it is not whole, so it cannot show that nothing else changed.") : null,
    table(["Destination", "Active", "Shadow", "Flows", "Last seen"], rows, evicted > 0 ? "No differences kept." : "No differences so far."),
    el("p", {}, promote, " ", out));
}

function explainSection(id) {
  const f = {
    dst: el("input", { id: "explain-dst", placeholder: "203.0.113.7:443", required: true }),
    tls: el("input", { id: "explain-tls", type: "checkbox", checked: true }),
    sni: el("input", { id: "explain-sni", placeholder: "api.example.com" }),
    method: el("input", { id: "explain-method", placeholder: "GET" }),
    path: el("input", { id: "explain-path", placeholder: "/v1/items" }),
  };
  const out = el("div", { id: "explain-result", role: "status", "aria-live": "polite" });
  const form = el("form", { class: "bar", onsubmit: async (ev) => {
    ev.preventDefault();
    const q = { dst: f.dst.value.trim(), tls: f.tls.checked };
    const name = f.sni.value.trim();
    if (name) q[f.tls.checked ? "sni" : "host"] = name;
    if (f.method.value.trim() || f.path.value.trim()) { q.method = f.method.value.trim(); q.path = f.path.value.trim(); }
    const r = await api("POST", "/v1/sandboxes/" + encodeURIComponent(id) + "/explain", q);
    out.replaceChildren(r.status === 200 ? explained(r.body) : failure(r));
  } },
  el("label", {}, "Destination (address:port)", f.dst), el("label", { class: "check" }, f.tls, "TLS"),
  el("label", {}, "SNI (TLS) or Host", f.sni), el("label", {}, "Method", f.method),
  el("label", {}, "Path", f.path), el("button", { type: "submit" }, "Explain"));
  return el("section", { "aria-labelledby": "h-explain" },
    el("h2", { id: "h-explain" }, "Explain a flow"), form, out);
}

function explained(v) {
  const rows = [["Verdict", verdictTag(v.verdict)], ["Reason", reasonLink(v.reason)], ["Rule", v.detail || "—"]];
  if ((v.attributed || []).length) rows.push(["Attributed names", v.attributed.join(", ")]);
  if (v.request) {
    rows.push(["Request", [verdictTag(v.request.verdict), " ", v.request.method + " " + v.request.path]]);
    if (v.request.reason) rows.push(["Request reason", reasonLink(v.request.reason)]);
    if (v.request.detail) rows.push(["Request rule", v.request.detail]);
  }
  return el("dl", { class: "facts" }, rows.map(([k, x]) => [el("dt", {}, k), el("dd", {}, x)]));
}

// === workers and operations ===

// Workers registered with one gateway undo each other's pushes: said first.
function shared(w) {
  const others = w.shares_gateway_with || [];
  return others.length ? "registered with the same gateway as " + others.join(", ") : "";
}

async function workers() {
  const g = generation;
  const r = await api("GET", "/v1/workers");
  if (g !== generation) return;
  if (r.status !== 200) return show(el("h1", {}, "Workers"), failure(r));
  const rows = r.body.workers.map((w) => el("tr", {},
    el("td", { class: "mono" }, w.id),
    el("td", {}, w.gateway && w.gateway.ready ? tag("ready", "good") : tag("not ready", "bad"),
      " ", el("span", { class: "note" }, (w.gateway && w.gateway.detail) || "")),
    el("td", { class: "mono" }, w.epoch || "—"),
    el("td", {}, w.sandboxes), el("td", {}, w.unpushed + (w.unpushed ? " (" + w.push_lag_s.toFixed(1) + " s behind)" : "")),
    el("td", {}, w.needs_resync ? "resync pending" : "in sync"),
    el("td", {}, [shared(w), w.last_error].filter(Boolean).join("; ") || "—")));
  show(el("h1", {}, "Workers"),
    table(["Worker", "Gateway", "Epoch", "Sandboxes", "Unpushed changes", "Resync", "Last error"], rows,
      "No workers registered."),
    el("p", { class: "note" }, "Probed " + clock() + "."));
}

async function operations() {
  const body = el("div", { id: "operations" });
  show(el("h1", {}, "Operations"), body);
  every(POLL_MS, async () => {
    const r = await api("GET", "/v1/operations");
    if (r.status !== 200) return body.replaceChildren(failure(r));
    const o = r.body;
    const lag = o.push_lag_s === undefined ? [] : [el("dt", {}, "Push lag"), el("dd", {}, o.push_lag_s.toFixed(1) + " s")];
    const rows = o.failures.map((f) => el("tr", {},
      el("td", { class: "mono" }, f.id), el("td", {}, f.kind),
      el("td", { class: "mono" }, el("a", { href: "#sandbox/" + encodeURIComponent(f.sandbox) }, f.sandbox)),
      el("td", {}, tag(f.state === "failed" ? "failed" : "retrying", "bad")), el("td", {}, String(f.attempts)),
      el("td", {}, f.error), el("td", { class: "mono" }, f.created_at)));
    body.replaceChildren(
      el("dl", { class: "facts" },
        el("dt", {}, "Queue depth"), el("dd", { id: "queue-depth" }, String(o.queued)),
        el("dt", {}, "Oldest queued"), el("dd", {}, o.oldest_queued_s.toFixed(1) + " s"),
        el("dt", {}, "Failed"), el("dd", {}, String(o.failed)), lag),
      el("h2", {}, "Failures and retries"),
      table(["Operation", "Kind", "Sandbox", "State", "Attempts", "Error", "Created"], rows, "No failures."),
      el("p", { class: "note" }, "Updated " + clock() + "; refreshes every " + POLL_MS / 1000 + " s."));
  });
}

// === reason codes (docs/reason-codes.md, as the repository has it) ===

async function reasons(code) {
  const g = generation;
  show(el("h1", {}, "Reason code " + code), el("p", { class: "note" }, "Loading…"));
  const resp = await fetch(REASONS, { cache: "no-store" });
  const text = resp.ok ? await resp.text() : "";
  if (g !== generation) return;
  const rows = [];
  for (const line of text.split("\n")) {
    const m = line.match(/^\| `([a-z_]+)` \|(.*)\|\s*$/);
    if (!m) continue;
    const cells = m[2].split(" | ").map((c) => c.replace(/`/g, "").trim());
    rows.push(el("tr", { id: "reason-" + m[1], class: m[1] === code ? "chosen" : "" },
      el("td", { class: "mono" }, m[1] === code ? m[1] + " (this one)" : m[1]), cells.map((c) => el("td", {}, c))));
  }
  show(el("h1", {}, "Reason code " + code),
    el("p", {}, el("a", { href: REASONS }, "docs/reason-codes.md"), " as a table; the code asked for is marked “this one”."),
    table(["Reason", "Meaning", "What to do"], rows, "The reason codes could not be read."));
  const chosen = document.getElementById("reason-" + code);
  if (chosen) chosen.scrollIntoView();
}

// === routing ===

async function queueLine() {
  if (!token()) return;
  const r = await api("GET", "/v1/operations?limit=1");
  const live = document.getElementById("live");
  live.textContent = r.status === 200 ? "Queue: " + r.body.queued + " queued · " + clock() : "";
}

// A fragment's part, percent-decoded; as it is when it is not valid.
function decoded(part) {
  try { return decodeURIComponent(part); } catch (e) { return part; }
}

function route() {
  for (const t of timers) clearInterval(t);
  timers = [];
  generation += 1;
  let hash = location.hash.slice(1);
  // A test or a link may hand the token in the fragment (never sent to the
  // server): it is kept in the tab and taken out of the address at once.
  // Only a tab with no token takes it: a link must not switch a logged-in
  // tab to another tenant's view unseen (log out first).
  if (hash.startsWith("token=")) {
    const [t, then] = hash.slice(6).split("&then=");
    if (!token()) sessionStorage.setItem(TOKEN_KEY, decoded(t));
    hash = then || "sandboxes";
    history.replaceState(null, "", "#" + hash);
  }
  const [path, query] = hash.split("?");
  const parts = path.split("/").map(decoded);
  for (const a of document.querySelectorAll("nav a")) {
    if (a.getAttribute("href") === "#" + (parts[0] === "sandbox" ? "sandboxes" : parts[0])) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (!token()) return login(location.hash);
  document.getElementById("logout").hidden = false;
  every(5000, queueLine);
  const pages = {
    sandboxes: () => sandboxes(query), sandbox: () => sandbox(parts.slice(1).join("/")),
    workers: workers, operations: operations, reasons: () => reasons(parts[1] || ""),
  };
  (pages[parts[0]] || pages.sandboxes)();
  document.getElementById("main").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  // The skip link moves the focus; followed as a link, its fragment would
  // be read as a page and leave the one the operator is on.
  document.querySelector("a.skip").addEventListener("click", (e) => {
    e.preventDefault();
    document.getElementById("main").focus();
  });
  document.getElementById("logout").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.hash = "#sandboxes";
    route();
  });
  window.addEventListener("hashchange", route);
  route();
});
