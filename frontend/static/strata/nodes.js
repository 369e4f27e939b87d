// Nodes: state, heartbeat age (ticking), tier capacities and the mode in force, live.
(function () {
  "use strict";
  const S = window.Strata;
  const nodes = new Map();
  let mode = "";
  const tbody = document.querySelector("#node-table tbody");

  function tierCell(node, name) {
    const tier = (node.tiers || []).find((t) => t.tier === name);
    if (!tier) return S.el("td", { class: "num", "data-tier": name }, "–");
    if (tier.available === false) return S.el("td", { class: "num error", "data-tier": name }, "unavailable");
    return S.el("td", { class: "num", "data-tier": name, "data-capacity": tier.capacity_bytes },
      S.bytes(tier.capacity_bytes), S.el("br"), S.el("span", { class: "hint" }, S.percent(tier.used_bytes, tier.capacity_bytes) + " used"));
  }

  function render() {
    const rows = [...nodes.values()].sort((a, b) => a.name.localeCompare(b.name)).map((n) => S.el("tr", { "data-node": n.name },
      S.el("th", { scope: "row" }, n.name),
      S.el("td", { class: "state-" + n.state, "data-field": "state" }, n.state),
      S.el("td", { "data-field": "age", "data-last-seen": n.last_seen }, S.age(n.last_seen)),
      S.el("td", { class: "num" }, S.seconds(n.heartbeat_seconds)),
      S.el("td", {}, n.host || "–"),
      S.el("td", { class: "mono" }, n.address || "none"),
      S.el("td", {}, n.version || "–"),
      ...S.TIERS.map((t) => tierCell(n, t)),
      S.el("td", {}, mode || "none")));
    tbody.replaceChildren(...(rows.length ? rows : [S.el("tr", {}, S.el("td", { colspan: 12 }, "No node has registered yet."))]));
  }

  async function snapshot() {
    const answer = await S.api("/api/v1/dashboard/overview/");
    nodes.clear();
    answer.nodes.forEach((n) => nodes.set(n.name, n));
    mode = answer.mode;
    document.getElementById("mode").textContent = mode || "none";
    render();
    return answer.seq;
  }

  function apply(event) {
    const p = event.payload;
    if (event.type === "node.heartbeat") {
      nodes.set(p.name, Object.assign(nodes.get(p.name) || {}, p));
    } else if (event.type === "node.state" && nodes.has(p.name)) {
      nodes.get(p.name).state = p.state;
    } else if (event.type === "mode.switched") {
      mode = p.mode;
      document.getElementById("mode").textContent = mode || "none";
    }
  }

  // Heartbeat ages tick between events.
  setInterval(() => {
    tbody.querySelectorAll('[data-field="age"]').forEach((cell) => { cell.textContent = S.age(cell.dataset.lastSeen); });
  }, 1000);

  S.live({ snapshot, apply, afterBatch: render });
})();
