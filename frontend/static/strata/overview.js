// Overview: every node's tiers filling and draining live, fleet totals, hit rates, time saved,
// movements per second and alerts.
(function () {
  "use strict";
  const S = window.Strata;
  const nodes = new Map();
  let watermarks = {};
  const tbody = document.querySelector("#nodes tbody");
  const eventsEl = document.getElementById("events");
  let finishedThisSecond = { moves: 0, evictions: 0 };

  // -- rendering ------------------------------------------------------------------------------
  function tierOf(node, name) { return (node.tiers || []).find((t) => t.tier === name); }

  function stacked(node) {
    const tiers = (node.tiers || []).filter((t) => t.available !== false);
    const capacity = tiers.reduce((sum, t) => sum + t.capacity_bytes, 0);
    const used = tiers.reduce((sum, t) => sum + t.used_bytes, 0);
    const bar = S.el("div", { class: "stack", role: "img",
      "aria-label": node.name + ": " + S.bytes(used) + " used of " + S.bytes(capacity) + " in all tiers" });
    tiers.forEach((t) => {
      if (!capacity || !t.used_bytes) return;
      bar.appendChild(S.el("span", { class: "tier-" + t.tier, title: t.tier + " " + S.bytes(t.used_bytes),
        style: "width:" + (100 * t.used_bytes / capacity).toFixed(2) + "%" }));
    });
    return bar;
  }

  function tierCell(node, name) {
    const tier = tierOf(node, name);
    if (!tier) return S.el("td", { "data-tier": name }, "–");
    if (tier.available === false) return S.el("td", { "data-tier": name, class: "error" }, "unavailable");
    const high = (watermarks[name] || {}).high;
    return S.el("td", { "data-tier": name, "data-used": tier.used_bytes, "data-capacity": tier.capacity_bytes },
      S.occupancyBar(tier.used_bytes, tier.capacity_bytes, node.name + " " + name, high),
      S.el("span", { class: "used" }, S.bytes(tier.used_bytes)), " / ", S.el("span", { class: "capacity" }, S.bytes(tier.capacity_bytes)));
  }

  function renderNodes() {
    const rows = [...nodes.values()].sort((a, b) => a.name.localeCompare(b.name)).map((node) => S.el("tr", { "data-node": node.name },
      S.el("th", { scope: "row" }, node.name),
      S.el("td", { class: "state-" + node.state, "data-field": "state" }, node.state),
      S.el("td", {}, stacked(node)),
      ...S.TIERS.map((tier) => tierCell(node, tier))));
    tbody.replaceChildren(...(rows.length ? rows : [S.el("tr", {}, S.el("td", { colspan: 7 }, "No node has registered yet."))]));
    renderTierCards();
  }

  function renderTierCards() {
    const cards = S.TIERS.map((tier) => {
      let used = 0, capacity = 0, count = 0;
      nodes.forEach((node) => {
        const t = tierOf(node, tier);
        if (t && t.available !== false && node.state !== "down") { used += t.used_bytes; capacity += t.capacity_bytes; count += 1; }
      });
      if (!count) return null;
      return S.el("div", { class: "card", "data-tier": tier },
        S.el("div", { class: "label" }, tier + " (" + count + " node" + (count === 1 ? "" : "s") + ")"),
        S.el("div", { class: "value" }, S.percent(used, capacity)),
        S.el("div", { class: "sub" }, S.bytes(used) + " of " + S.bytes(capacity)));
    }).filter(Boolean);
    document.getElementById("tier-cards").replaceChildren(...cards);
  }

  function renderAlerts(alerts) {
    const list = document.getElementById("alerts");
    if (!alerts.length) { list.replaceChildren(S.el("li", { class: "none" }, "No alerts: every node is up and every tier is within its watermarks.")); return; }
    list.replaceChildren(...alerts.map((a) => S.el("li", { class: a.severity, "data-kind": a.kind },
      S.el("strong", {}, a.severity === "critical" ? "Critical: " : "Warning: "), a.message)));
  }

  function logEvent(event) {
    let text = event.type;
    const p = event.payload || {};
    if (event.type === "node.heartbeat") text += " " + p.name;
    else if (event.type === "node.state") text += " " + p.name + " " + p.previous + " → " + p.state;
    else if (event.type === "blocks.registered") text += " " + p.blocks + " block(s), " + p.new + " new (" + p.source + ")";
    else if (event.type === "movement.planned") text += " " + p.moves + " move(s), " + p.evictions + " eviction(s), " + S.bytes(p.bytes);
    else if (event.type === "movement.finished") text += " " + p.node + ": " + p.done + " done, " + p.failed + " failed";
    else if (event.type === "mode.switched") text += " " + (p.previous || "none") + " → " + p.mode;
    else if (event.type === "policy.changed") text += " v" + p.version + " " + p.action + " by " + p.author;
    else if (event.type === "mode.followed") text += " v" + p.version + " " + p.reason;
    eventsEl.prepend(S.el("li", { value: event.seq }, text));
    while (eventsEl.children.length > 30) eventsEl.lastChild.remove();
  }

  // -- data -----------------------------------------------------------------------------------
  async function loadOverview() {
    const snapshot = await S.api("/api/v1/dashboard/overview/");
    watermarks = snapshot.watermarks || {};
    nodes.clear();
    snapshot.nodes.forEach((node) => nodes.set(node.name, node));
    document.getElementById("mode").textContent = snapshot.mode || "none";
    document.getElementById("policy-version").textContent = String(snapshot.policy_version);
    renderAlerts(snapshot.alerts);
    renderNodes();
    return snapshot.seq;
  }

  let alertsTimer = null;
  function refreshAlertsSoon() {
    clearTimeout(alertsTimer);
    alertsTimer = setTimeout(async () => {
      try {
        const snapshot = await S.api("/api/v1/dashboard/overview/");
        renderAlerts(snapshot.alerts);
        document.getElementById("mode").textContent = snapshot.mode || "none";
        document.getElementById("policy-version").textContent = String(snapshot.policy_version);
      } catch (err) { /* the next event or snapshot retries */ }
    }, 300);
  }

  function countFinished(payload) {
    let evictions = 0;
    Object.entries(payload.routes || {}).forEach(([route, count]) => {
      if (/evict|->$/.test(route)) evictions += Number(count) || 0;
    });
    finishedThisSecond.evictions += evictions;
    finishedThisSecond.moves += Math.max(0, (Number(payload.done) || 0) - evictions);
  }

  function apply(event) {
    const p = event.payload;
    if (event.type === "node.heartbeat") {
      nodes.set(p.name, Object.assign(nodes.get(p.name) || {}, p));
    } else if (event.type === "node.state") {
      const node = nodes.get(p.name);
      if (node) node.state = p.state;
      refreshAlertsSoon();
    } else if (event.type === "movement.finished") {
      countFinished(p);
      refreshAlertsSoon();
    } else if (event.type === "mode.switched" || event.type === "policy.changed") {
      refreshAlertsSoon();
    }
    logEvent(event);
  }

  // -- charts ---------------------------------------------------------------------------------
  S.tierSwatches(document.getElementById("legend"));
  const tierSeries = S.TIERS.map((tier) => ({ label: tier, color: "--tier-" + tier }));
  const occupancy = S.timeChart(document.getElementById("chart-occupancy"), {
    title: "Bytes used per tier (fleet)", series: tierSeries, format: S.bytes,
    summary: document.getElementById("chart-occupancy-text"),
    describe: (v) => "Now: " + S.TIERS.map((t, i) => t + " " + S.bytes(v[i])).join(", ") + ".",
  });
  const hits = S.timeChart(document.getElementById("chart-hits"), {
    title: "Hit rate by tier", series: tierSeries, yRange: [0, 1],
    format: (v) => (v === null ? "–" : (100 * v).toFixed(0) + "%"),
    summary: document.getElementById("chart-hits-text"),
    describe: (v) => "Last 5 s: " + S.TIERS.map((t, i) => t + " " + (v[i] === null ? "–" : (100 * v[i]).toFixed(1) + "%")).join(", ") + ".",
  });
  const moves = S.timeChart(document.getElementById("chart-moves"), {
    title: "Movements and evictions per second",
    series: [{ label: "moves", color: "--tier-host" }, { label: "evictions", color: "--bad" }],
    format: (v) => S.number(v, 1),
    summary: document.getElementById("chart-moves-text"),
    describe: (v) => "Last second: " + v[0] + " move(s), " + v[1] + " eviction(s).",
  });

  setInterval(() => {
    if (!nodes.size) return;  // nothing to plot before the first snapshot
    occupancy.push(S.TIERS.map((tier) => {
      let used = 0;
      nodes.forEach((node) => { const t = tierOf(node, tier); if (t && node.state !== "down") used += t.used_bytes; });
      return used;
    }));
    moves.push([finishedThisSecond.moves, finishedThisSecond.evictions]);
    finishedThisSecond = { moves: 0, evictions: 0 };
  }, 1000);

  // Fragment reuse: the fleet's reused tokens by kind and quality samples, and the r and reuse
  // mode of every (node, model, namespace), from the same counters as the hit rate.
  function renderReuse(reuse) {
    if (!reuse) return;
    const samples = reuse.quality_samples || {};
    document.getElementById("reuse-prefix").textContent = S.number(reuse.reused_tokens.prefix);
    document.getElementById("reuse-fragment").textContent = S.number(reuse.reused_tokens.fragment);
    document.getElementById("reuse-recomputed").textContent = "of which " + S.number(reuse.recomputed_tokens) + " recomputed";
    document.getElementById("reuse-ratio").textContent = reuse.recompute_ratio === null ? "–" : S.percent(reuse.recompute_ratio, 1);
    document.getElementById("reuse-quality").textContent = S.number(samples.agreed) + " / " + S.number(samples.disagreed);
    document.getElementById("reuse-dropped").textContent = "agreed / disagreed; " + S.number(samples.dropped) + " dropped (checker busy)";
    const configured = reuse.nodes.map((n) => n.enabled
      ? n.node + " (" + n.model + "): r " + S.number(n.default_recompute_percent, 1) + "%"
      : n.node + ": off");
    document.getElementById("reuse-nodes").textContent = configured.length
      ? "Configured r of namespaces without their own: " + configured.join(" · ")
      : "No node's engine server answered.";
    const rows = reuse.namespaces.map((row) => S.el("tr", { "data-node": row.node, "data-namespace": row.namespace },
      S.el("td", {}, row.node), S.el("td", {}, row.model), S.el("th", { scope: "row" }, row.namespace),
      S.el("td", { class: "num", "data-field": "percent" }, S.number(row.recompute_percent, 1) + "%"),
      S.el("td", { class: row.prefix_only ? "mode-prefix-only" : "mode-blend", "data-field": "mode" },
        row.prefix_only ? "prefix-only (fallen back)" : "blend"),
      S.el("td", { class: "num" }, S.number(row.samples.agreed) + " / " + S.number(row.samples.disagreed)),
      S.el("td", { class: "num" }, row.window_agreement === null ? "–" : S.percent(row.window_agreement, 1))));
    const none = reuse.nodes.some((n) => n.enabled)
      ? "No namespace has made a blended request yet." : "No node reuses fragments (STRATA_BLEND is off).";
    document.querySelector("#blend-namespaces tbody").replaceChildren(
      ...(rows.length ? rows : [S.el("tr", {}, S.el("td", { colspan: 7 }, none))]));
  }

  let previousCache = null;
  async function pollCache() {
    try {
      const stats = await S.api("/api/v1/dashboard/cache/");
      document.getElementById("hit-rate").textContent = S.percent(stats.hit_tokens, stats.lookup_tokens);
      document.getElementById("hit-detail").textContent = S.number(stats.hit_tokens) + " of " + S.number(stats.lookup_tokens) + " tokens looked up";
      renderReuse(stats.fragment_reuse);
      const reasons = stats.evictions_by_reason || {};
      const evicted = Object.values(reasons).reduce((sum, n) => sum + n, 0);
      document.getElementById("evictions").textContent = S.number(evicted);
      document.getElementById("evictions-detail").textContent =
        (Object.keys(reasons).sort().map((r) => r + " " + S.number(reasons[r])).join(", ") || "none yet") +
        "; " + S.number(stats.write_backs_refused || 0) + " write-back(s) refused";
      document.getElementById("remote-unverified").textContent = S.number(stats.remote_unverified || 0);
      if (previousCache) {
        const looked = stats.lookup_tokens - previousCache.lookup_tokens;
        hits.push(S.TIERS.map((tier) => looked > 0
          ? Math.max(0, ((stats.hit_tokens_by_tier[tier] || 0) - (previousCache.hit_tokens_by_tier[tier] || 0)) / looked)
          : null));
      }
      previousCache = stats;
    } catch (err) {
      document.getElementById("hit-detail").textContent = "counters unavailable: " + err.message;
    }
  }

  async function pollRequests() {
    try {
      const answer = await S.api("/api/v1/requests/");
      const s = answer.summary;
      document.getElementById("tokens-cached").textContent = S.number(s.cached_tokens);
      document.getElementById("tokens-computed").textContent = S.number(s.computed_tokens);
      document.getElementById("tokens-window").textContent = "latest " + s.requests + " request(s) of the nodes";
      document.getElementById("per-token").textContent = "prefill per token " + S.seconds(s.prefill_seconds_per_token);
      document.getElementById("time-saved").textContent = S.seconds(s.saved_seconds);
    } catch (err) {
      document.getElementById("tokens-window").textContent = "requests unavailable: " + err.message;
    }
  }

  pollCache(); pollRequests();
  setInterval(pollCache, 5000);
  setInterval(pollRequests, 10000);
  setInterval(refreshAlertsSoon, 15000);

  S.live({ snapshot: loadOverview, apply, afterBatch: renderNodes });
})();
