// Policies: tier policies, priority classes, namespace quotas (with their use) and modes with inline
// validation errors (the API names the field), dry-run previews, version history with diff and
// rollback. Viewers get read-only tables.
(function () {
  "use strict";
  const S = window.Strata;
  const canEdit = S.canEdit();
  const notice = document.getElementById("notice");
  const state = { tiers: [], classes: [], modes: [], quotas: [], usage: [] };

  function say(text, good) {
    notice.replaceChildren(S.el("p", { class: "notice " + (good ? "good" : "bad") }, text));
  }

  function fraction(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(0) + "%"; }

  // Field errors of a proposal name paths such as overrides.tiers[0].high_watermark: show them on
  // the input of the same name.
  function errorsByInput(error) {
    if (!error || !error.body || typeof error.body !== "object" || error.body.detail) return error;
    const body = {};
    Object.entries(error.body).forEach(([field, problems]) => {
      const name = field.split(".").pop().replace(/\[\d+\]$/, "");
      body[name] = (body[name] || []).concat(problems);
    });
    return { body, message: error.message };
  }

  function value(form, name) {
    const input = form.elements[name];
    return input ? input.value.trim() : "";
  }

  // A number when it reads as one; otherwise the text as typed, so the API names the field.
  function numeric(text) { return text !== "" && !Number.isNaN(Number(text)) ? Number(text) : text; }

  // -- tier policies ----------------------------------------------------------------------------
  function renderTiers() {
    document.querySelector("#tier-table tbody").replaceChildren(...state.tiers.map((p) => S.el("tr", { "data-policy": p.id, "data-tier": p.tier },
      S.el("th", { scope: "row" }, p.tier), S.el("td", {}, p.node_group || "every node"),
      S.el("td", { class: "num" }, p.capacity_bytes === null ? "reported" : S.bytes(p.capacity_bytes)),
      S.el("td", { class: "num" }, fraction(p.capacity_fraction)),
      S.el("td", { class: "num", "data-field": "high_watermark" }, fraction(p.high_watermark)),
      S.el("td", { class: "num", "data-field": "low_watermark" }, fraction(p.low_watermark)),
      S.el("td", {}, p.algorithm), S.el("td", { class: "num" }, p.ttl_seconds === null ? "–" : S.seconds(p.ttl_seconds)),
      S.el("td", { class: "num" }, p.min_accesses), S.el("td", {}, p.demote_tier || "next"),
      canEdit ? S.el("td", {}, S.el("button", { type: "button", "aria-label": "Edit the " + p.tier + " policy" + (p.node_group ? " of " + p.node_group : ""),
        onclick: () => editTier(p) }, "Edit")) : null)));
  }

  const tierForm = document.getElementById("tier-form");
  const TIER_FIELDS = ["capacity_bytes", "capacity_fraction", "high_watermark", "low_watermark", "algorithm",
    "ttl_seconds", "min_accesses", "demote_tier"];

  function editTier(p) {
    S.clearFieldErrors(tierForm);
    tierForm.elements.id.value = p.id;
    tierForm.elements.tier.value = p.tier;
    tierForm.elements.tier.disabled = true;
    tierForm.elements.node_group.value = p.node_group;
    tierForm.elements.node_group.disabled = true;
    TIER_FIELDS.forEach((f) => { tierForm.elements[f].value = p[f] === null ? "" : p[f]; });
    tierForm.elements.comment.value = "";
    document.getElementById("tier-form-h").textContent = "Edit the " + p.tier + " tier policy" + (p.node_group ? " of " + p.node_group : "");
    tierForm.elements.high_watermark.focus();
  }

  function tierBody() {
    const body = {};
    TIER_FIELDS.forEach((f) => {
      const text = value(tierForm, f);
      if (f === "algorithm" || f === "demote_tier") body[f] = text;
      else if (text === "") { if (f === "capacity_bytes" || f === "ttl_seconds") body[f] = null; }
      else body[f] = numeric(text);
    });
    return body;
  }

  if (tierForm) {
    tierForm.addEventListener("submit", async (e) => {
      e.preventDefault();
      S.clearFieldErrors(tierForm);
      const id = tierForm.elements.id.value;
      const body = Object.assign(tierBody(), { comment: value(tierForm, "comment") });
      try {
        let saved;
        if (id) saved = await S.api("/api/v1/tier-policies/" + id + "/", { method: "PATCH", body });
        else saved = await S.api("/api/v1/tier-policies/", { method: "POST", body: Object.assign(body, { tier: tierForm.elements.tier.value, node_group: value(tierForm, "node_group") }) });
        say("Saved the " + saved.tier + " tier policy.", true);
        await load();
        editTier(saved);
      } catch (err) {
        S.showFieldErrors(tierForm, err);
        say("Not saved: " + err.message, false);
      }
    });
    tierForm.querySelector('[data-action="preview"]').addEventListener("click", () => {
      const proposal = Object.assign(tierBody(), { tier: tierForm.elements.tier.value, node_group: value(tierForm, "node_group") });
      dryRun({ tiers: [proposal] }, tierForm);
    });
    tierForm.querySelector('[data-action="reset"]').addEventListener("click", () => {
      tierForm.reset();
      tierForm.elements.id.value = "";
      tierForm.elements.tier.disabled = false;
      tierForm.elements.node_group.disabled = false;
      S.clearFieldErrors(tierForm);
      document.getElementById("tier-form-h").textContent = "New tier policy";
    });
  }

  // -- priority classes -------------------------------------------------------------------------
  const classForm = document.getElementById("class-form");

  function renderClasses() {
    document.querySelector("#class-table tbody").replaceChildren(...state.classes.map((c) => S.el("tr", { "data-class": c.name },
      S.el("th", { scope: "row" }, c.name), S.el("td", { class: "num" }, c.weight), S.el("td", { class: "num" }, fraction(c.device_share)),
      S.el("td", {}, c.namespaces.length ? c.namespaces.join(", ") : (c.name === "default" ? "every other namespace" : "none")),
      S.el("td", {}, new Date(c.updated_at).toLocaleString()),
      canEdit ? S.el("td", {}, S.el("button", { type: "button", "aria-label": "Edit class " + c.name, onclick: () => editClass(c) }, "Edit"),
        " ", c.name === "default" ? null : S.el("button", { type: "button", class: "danger", "aria-label": "Delete class " + c.name, onclick: () => deleteClass(c) }, "Delete")) : null)));
  }

  function editClass(c) {
    S.clearFieldErrors(classForm);
    classForm.elements.editing.value = c.name;
    classForm.elements.name.value = c.name;
    classForm.elements.name.disabled = true;
    classForm.elements.weight.value = c.weight;
    classForm.elements.device_share.value = c.device_share;
    classForm.elements.namespaces.value = c.namespaces.join(", ");
    document.getElementById("class-form-h").textContent = "Edit class " + c.name;
    classForm.elements.weight.focus();
  }

  async function deleteClass(c) {
    if (!window.confirm("Delete priority class " + c.name + "?")) return;
    try { await S.api("/api/v1/priority-classes/" + c.name + "/", { method: "DELETE" }); say("Deleted class " + c.name + ".", true); await load(); }
    catch (err) { say("Not deleted: " + err.message, false); }
  }

  if (classForm) {
    classForm.addEventListener("submit", async (e) => {
      e.preventDefault();
      S.clearFieldErrors(classForm);
      const editing = classForm.elements.editing.value;
      const body = {
        weight: numeric(value(classForm, "weight")), device_share: numeric(value(classForm, "device_share")),
        namespaces: value(classForm, "namespaces").split(",").map((n) => n.trim()).filter(Boolean),
        comment: value(classForm, "comment"),
      };
      try {
        if (editing) await S.api("/api/v1/priority-classes/" + editing + "/", { method: "PATCH", body });
        else await S.api("/api/v1/priority-classes/", { method: "POST", body: Object.assign(body, { name: value(classForm, "name") }) });
        say("Saved class " + (editing || value(classForm, "name")) + ".", true);
        await load();
      } catch (err) {
        S.showFieldErrors(classForm, err);
        say("Not saved: " + err.message, false);
      }
    });
    classForm.querySelector('[data-action="reset"]').addEventListener("click", () => {
      classForm.reset(); classForm.elements.editing.value = ""; classForm.elements.name.disabled = false;
      S.clearFieldErrors(classForm); document.getElementById("class-form-h").textContent = "New priority class";
    });
  }

  // -- namespace quotas -------------------------------------------------------------------------
  const quotaForm = document.getElementById("quota-form");

  function renderQuotas() {
    const ids = new Map(state.quotas.map((q) => [q.namespace + "@" + q.tier, q]));
    document.querySelector("#quota-table tbody").replaceChildren(...state.usage.map((u) => {
      const quota = ids.get(u.namespace + "@" + u.tier);
      return S.el("tr", { "data-quota": u.namespace + "@" + u.tier, class: u.over ? "over-quota" : "" },
        S.el("th", { scope: "row" }, u.namespace), S.el("td", {}, u.tier),
        S.el("td", { class: "num" }, u.quota_bytes === null ? "none" : S.bytes(u.quota_bytes)),
        S.el("td", { class: "num", "data-field": "used" }, S.bytes(u.used_bytes) + (u.over ? " (over)" : "")),
        S.el("td", {}, u.nodes.length ? u.nodes.map((n) => (n.node || "fleet") + ": " + S.bytes(n.used_bytes) + (n.over ? " (over)" : "")).join(", ") : "–"),
        canEdit && quota ? S.el("td", {},
          S.el("button", { type: "button", "aria-label": "Edit the " + u.tier + " quota of " + u.namespace, onclick: () => editQuota(quota) }, "Edit"), " ",
          S.el("button", { type: "button", class: "danger", "aria-label": "Delete the " + u.tier + " quota of " + u.namespace, onclick: () => deleteQuota(quota) }, "Delete")) : (canEdit ? S.el("td", {}) : null));
    }));
  }

  function editQuota(q) {
    S.clearFieldErrors(quotaForm);
    quotaForm.elements.id.value = q.id;
    quotaForm.elements.namespace.value = q.namespace;
    quotaForm.elements.namespace.disabled = true;
    quotaForm.elements.tier.value = q.tier;
    quotaForm.elements.tier.disabled = true;
    quotaForm.elements.bytes.value = q.bytes;
    document.getElementById("quota-form-h").textContent = "Edit the " + q.tier + " quota of " + q.namespace;
    quotaForm.elements.bytes.focus();
  }

  async function deleteQuota(q) {
    if (!window.confirm("Delete the " + q.tier + " quota of " + q.namespace + "?")) return;
    try { await S.api("/api/v1/namespace-quotas/" + q.id + "/", { method: "DELETE" }); say("Deleted the " + q.tier + " quota of " + q.namespace + ".", true); await load(); }
    catch (err) { say("Not deleted: " + err.message, false); }
  }

  if (quotaForm) {
    quotaForm.addEventListener("submit", async (e) => {
      e.preventDefault();
      S.clearFieldErrors(quotaForm);
      const id = quotaForm.elements.id.value;
      const body = { bytes: numeric(value(quotaForm, "bytes")), comment: value(quotaForm, "comment") };
      try {
        let saved;
        if (id) saved = await S.api("/api/v1/namespace-quotas/" + id + "/", { method: "PATCH", body });
        else saved = await S.api("/api/v1/namespace-quotas/", { method: "POST", body: Object.assign(body, { namespace: value(quotaForm, "namespace"), tier: quotaForm.elements.tier.value }) });
        say("Saved the " + saved.tier + " quota of " + saved.namespace + ".", true);
        await load();
        editQuota(saved);
      } catch (err) {
        S.showFieldErrors(quotaForm, err);
        say("Not saved: " + err.message, false);
      }
    });
    quotaForm.querySelector('[data-action="reset"]').addEventListener("click", () => {
      quotaForm.reset(); quotaForm.elements.id.value = "";
      quotaForm.elements.namespace.disabled = false; quotaForm.elements.tier.disabled = false;
      S.clearFieldErrors(quotaForm); document.getElementById("quota-form-h").textContent = "New quota";
    });
  }

  // -- modes ------------------------------------------------------------------------------------
  const modeForm = document.getElementById("mode-form");

  function renderModes() {
    document.querySelector("#mode-table tbody").replaceChildren(...state.modes.map((m) => S.el("tr", { "data-mode": m.name },
      S.el("th", { scope: "row" }, m.name), S.el("td", {}, m.kind), S.el("td", {}, m.description),
      S.el("td", {}, S.el("code", {}, JSON.stringify(m.overrides))),
      S.el("td", { "data-field": "active" }, m.active ? "active" : "–"),
      canEdit ? S.el("td", {},
        m.active ? S.el("button", { type: "button", "aria-label": "Deactivate mode " + m.name, onclick: () => switchMode(m, "deactivate") }, "Deactivate")
          : S.el("button", { type: "button", class: "primary", "aria-label": "Activate mode " + m.name, onclick: () => switchMode(m, "activate") }, "Activate"),
        " ", S.el("button", { type: "button", "aria-label": "Edit mode " + m.name, onclick: () => editMode(m) }, "Edit")) : null)));
  }

  async function switchMode(m, verb) {
    try {
      const answer = await S.api("/api/v1/modes/" + m.name + "/" + verb + "/", { method: "POST", body: {} });
      say((verb === "activate" ? "Mode " + m.name + " is active" : "Mode " + m.name + " stopped") + "; policy version " + answer.version + ".", true);
      await load();
    } catch (err) { say("Mode not switched: " + err.message, false); }
  }

  function editMode(m) {
    S.clearFieldErrors(modeForm);
    modeForm.elements.editing.value = m.name;
    modeForm.elements.name.value = m.name;
    modeForm.elements.name.disabled = true;
    modeForm.elements.kind.value = m.kind;
    modeForm.elements.description.value = m.description;
    modeForm.elements.overrides.value = JSON.stringify(m.overrides, null, 2);
    document.getElementById("mode-form-h").textContent = "Edit mode " + m.name;
    modeForm.elements.overrides.focus();
  }

  function overridesOf(form) {
    try { return JSON.parse(value(form, "overrides") || "{}"); } catch (err) {
      S.showFieldErrors(form, { body: { overrides: ["not valid JSON: " + err.message] } });
      return undefined;
    }
  }

  if (modeForm) {
    modeForm.addEventListener("submit", async (e) => {
      e.preventDefault();
      S.clearFieldErrors(modeForm);
      const overrides = overridesOf(modeForm);
      if (overrides === undefined) { say("Not saved: the overrides are not valid JSON.", false); return; }
      const editing = modeForm.elements.editing.value;
      const body = { kind: modeForm.elements.kind.value, description: value(modeForm, "description"), overrides, comment: value(modeForm, "comment") };
      try {
        if (editing) await S.api("/api/v1/modes/" + editing + "/", { method: "PATCH", body });
        else await S.api("/api/v1/modes/", { method: "POST", body: Object.assign(body, { name: value(modeForm, "name") }) });
        say("Saved mode " + (editing || value(modeForm, "name")) + ".", true);
        await load();
      } catch (err) {
        S.showFieldErrors(modeForm, errorsByInput(err));
        say("Not saved: " + err.message, false);
      }
    });
    modeForm.querySelector('[data-action="preview"]').addEventListener("click", () => {
      const overrides = overridesOf(modeForm);
      if (overrides !== undefined) dryRun(overrides, modeForm);
    });
    modeForm.querySelector('[data-action="reset"]').addEventListener("click", () => {
      modeForm.reset(); modeForm.elements.editing.value = ""; modeForm.elements.name.disabled = false;
      S.clearFieldErrors(modeForm); document.getElementById("mode-form-h").textContent = "New mode";
    });
  }

  // -- dry run ----------------------------------------------------------------------------------
  async function dryRun(proposal, form) {
    const out = document.getElementById("dry-result");
    out.replaceChildren(S.el("p", { class: "status" }, "Planning…"));
    try {
      const r = await S.api("/api/v1/policies/dry-run/", { method: "POST", body: proposal });
      if (form) S.clearFieldErrors(form);
      const routes = Object.entries(r.by_route || {});
      out.replaceChildren(...[
        S.el("p", { class: "notice good", "data-field": "dry-run-summary" },
          "Would move " + S.number(r.moves) + " block(s), " + S.bytes(r.bytes_moved) + ", and evict " +
          S.number(r.evictions) + " block(s), " + S.bytes(r.bytes_evicted) + ". Nothing was moved."),
        routes.length ? S.el("table", { "aria-label": "Dry run by route" },
          S.el("thead", {}, S.el("tr", {}, S.el("th", { scope: "col" }, "Route"), S.el("th", { scope: "col", class: "num" }, "Blocks"), S.el("th", { scope: "col", class: "num" }, "Bytes"))),
          S.el("tbody", {}, ...routes.map(([route, v]) => S.el("tr", {}, S.el("td", {}, route),
            S.el("td", { class: "num" }, S.number(typeof v === "object" ? v.blocks : v)), S.el("td", { class: "num" }, typeof v === "object" ? S.bytes(v.bytes) : "–"))))) : null,
      ].filter(Boolean));
    } catch (err) {
      if (form) S.showFieldErrors(form, errorsByInput(err));
      out.replaceChildren(S.el("p", { class: "notice bad" }, "Dry run refused: " + err.message));
    }
  }

  const dryForm = document.getElementById("dry-form");
  if (dryForm) {
    dryForm.addEventListener("submit", (e) => {
      e.preventDefault();
      S.clearFieldErrors(dryForm);
      const overrides = overridesOf(dryForm);
      if (overrides !== undefined) dryRun(overrides, dryForm);
    });
  }

  // -- versions ---------------------------------------------------------------------------------
  function renderVersions(versions) {
    document.querySelector("#version-table tbody").replaceChildren(...versions.map((v) => S.el("tr", { "data-version": v.number },
      S.el("td", { class: "num" }, v.number), S.el("td", {}, v.action), S.el("td", {}, v.author || "(built in)"),
      S.el("td", {}, v.comment), S.el("td", {}, new Date(v.created_at).toLocaleString()),
      S.el("td", {}, v.number > 1 ? S.el("button", { type: "button", "aria-label": "Show what version " + v.number + " changed", onclick: () => diff(v.number) }, "Diff") : null,
        " ", canEdit && v.number !== state.version ? S.el("button", { type: "button", class: "danger", "aria-label": "Roll back to version " + v.number, onclick: () => rollback(v.number) }, "Roll back to this") : null))));
  }

  async function diff(number) {
    const out = document.getElementById("diff");
    try {
      const d = await S.api("/api/v1/policy-versions/" + number + "/diff/");
      const pre = S.el("pre", { class: "diff", "aria-label": "Changes from version " + d.against + " to " + d.number });
      d.changes.forEach((c) => {
        if (c.change !== "added") pre.appendChild(S.el("span", { class: "del" }, "- " + c.path + " = " + JSON.stringify(c.before) + "\n"));
        if (c.change !== "removed") pre.appendChild(S.el("span", { class: "add" }, "+ " + c.path + " = " + JSON.stringify(c.after) + "\n"));
      });
      if (!d.changes.length) pre.textContent = "No change.";
      out.replaceChildren(S.el("h3", {}, "Version " + d.number + " against " + d.against), pre);
    } catch (err) { out.replaceChildren(S.el("p", { class: "notice bad" }, "Diff unavailable: " + err.message)); }
  }

  async function rollback(number) {
    if (!window.confirm("Restore the policies of version " + number + "? This writes a new version.")) return;
    try {
      const v = await S.api("/api/v1/policy-versions/" + number + "/rollback/", { method: "POST", body: { comment: "rolled back from the dashboard" } });
      say("Rolled back to version " + number + "; the policies are now version " + v.number + ".", true);
      await load();
    } catch (err) { say("Not rolled back: " + err.message, false); }
  }

  // -- loading ----------------------------------------------------------------------------------
  async function load() {
    const [tiers, classes, modes, quotas, usage, versions, overview] = await Promise.all([
      S.apiAll("/api/v1/tier-policies/"), S.apiAll("/api/v1/priority-classes/"), S.apiAll("/api/v1/modes/"),
      S.apiAll("/api/v1/namespace-quotas/"), S.api("/api/v1/namespace-quotas/usage/"),
      S.api("/api/v1/policy-versions/?page_size=50"), S.api("/api/v1/dashboard/overview/")]);
    Object.assign(state, { tiers, classes, modes, quotas, usage, version: overview.policy_version });
    document.getElementById("mode").textContent = overview.mode || "none";
    document.getElementById("version").textContent = overview.policy_version;
    renderTiers(); renderClasses(); renderQuotas(); renderModes(); renderVersions(versions.results);
    return overview.seq;
  }

  let reloadTimer = null;
  S.live({
    snapshot: load,
    apply: (event) => {
      if (event.type === "policy.changed" || event.type === "mode.switched") {
        clearTimeout(reloadTimer);
        reloadTimer = setTimeout(() => load().catch((err) => say("Reload failed: " + err.message, false)), 200);
      }
    },
  });
})();
