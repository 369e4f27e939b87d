// Requests: the engines' per-request, per-layer timelines (which tier served the blocks, stall per
// layer), fetched by the control plane from every node's engine server.
(function () {
  "use strict";
  const S = window.Strata;
  const tbody = document.querySelector("#request-table tbody");
  const form = document.getElementById("filter");
  let requests = [];
  let selected = null;
  let timer = null;

  function tiers(t) {
    const parts = Object.entries(t.hit_blocks_by_tier || {}).filter(([, n]) => n).map(([tier, n]) => tier + " " + n);
    const fragments = Object.entries(t.fragment_blocks_by_tier || {}).filter(([, n]) => n).map(([tier, n]) => tier + " " + n);
    if (fragments.length) parts.push("fragments from " + fragments.join(", "));
    return parts.length ? parts.join(", ") : "none (recomputed)";
  }

  function key(t) { return t.node + "/" + t.request_id; }

  function render() {
    const rows = requests.map((t) => {
      const open = S.el("button", { type: "button", "aria-label": "Show timeline of request " + t.request_id, onclick: () => show(t) }, t.request_id.slice(0, 14));
      const worst = (t.layer_stall_s || []).reduce((m, v) => Math.max(m, v), 0);
      return S.el("tr", { "data-request": t.request_id, class: selected === key(t) ? "selected" : "" },
        S.el("td", {}, new Date(t.started_at * 1000).toLocaleTimeString()), S.el("td", {}, t.node),
        S.el("th", { scope: "row" }, open), S.el("td", {}, t.namespace),
        S.el("td", { class: "num" }, S.number(t.prompt_tokens)), S.el("td", { class: "num" }, S.number(t.cached_tokens)),
        S.el("td", {}, tiers(t)), S.el("td", {}, t.decision + (t.layerwise ? "" : " (whole)")),
        S.el("td", { class: "num" }, S.seconds(t.ttft_s)), S.el("td", { class: "num" }, S.seconds(t.load_s)),
        S.el("td", { class: "num" }, S.seconds(t.prefill_s)), S.el("td", { class: "num" }, S.seconds(worst)));
    });
    tbody.replaceChildren(...(rows.length ? rows : [S.el("tr", {}, S.el("td", { colspan: 12 }, "No request has been served yet."))]));
  }

  function show(t) {
    selected = key(t);
    render();
    const section = document.getElementById("detail");
    section.hidden = false;
    document.getElementById("detail-h").textContent = "Request " + t.request_id + " on " + t.node;
    const total = Object.values(t.hit_blocks_by_tier || {}).reduce((a, b) => a + b, 0);
    const split = S.el("div", { class: "stack", role: "img", "aria-label": "Blocks served by tier: " + tiers(t) });
    Object.entries(t.hit_blocks_by_tier || {}).forEach(([tier, n]) => {
      if (total && n) split.appendChild(S.el("span", { class: "tier-" + tier, style: "width:" + (100 * n / total) + "%", title: tier + " " + n }));
    });
    document.getElementById("tier-split").replaceChildren(split,
      S.el("p", { class: "hint" }, S.number(t.cached_tokens) + " of " + S.number(t.prompt_tokens) + " prompt tokens from cache; blocks by tier: " + tiers(t) +
        (t.fragment_tokens ? "; reused: prefix " + S.number(t.prefix_tokens) + ", fragment " + S.number(t.fragment_tokens) +
          " (" + S.number(t.recomputed_tokens) + " recomputed at r " + S.number(t.blend_percent, 1) + "%)" : "") +
        (t.load_failures ? "; " + t.load_failures + " load failure(s) recomputed" : "")));
    const stalls = t.layer_stall_s || [];
    const worst = stalls.reduce((m, v) => Math.max(m, v), 0);
    const loaded = t.layer_loaded_at_s || [];
    const layers = Math.max(stalls.length, loaded.length);
    const rows = [];
    for (let i = 0; i < layers; i += 1) {
      const stall = stalls[i] || 0;
      rows.push(S.el("tr", {}, S.el("td", { class: "num" }, i), S.el("td", { class: "num" }, loaded[i] === undefined ? "–" : S.seconds(loaded[i])),
        S.el("td", { class: "num" }, S.seconds(stall)), S.el("td", {}, S.occupancyBar(stall, worst || 1, "layer " + i + " stall"))));
    }
    document.querySelector("#layers tbody").replaceChildren(...(rows.length ? rows : [S.el("tr", {}, S.el("td", { colspan: 4 }, "No cached block was loaded for this request."))]));
  }

  async function load() {
    const node = form.node.value;
    try {
      const answer = await S.api("/api/v1/requests/" + (node ? "?node=" + encodeURIComponent(node) : ""));
      requests = answer.requests;
      const s = answer.summary;
      document.getElementById("s-requests").textContent = S.number(s.requests);
      document.getElementById("s-cached").textContent = S.number(s.cached_tokens);
      document.getElementById("s-computed").textContent = S.number(s.computed_tokens);
      document.getElementById("s-reuse").textContent = S.number(s.prefix_tokens) + " / " + S.number(s.fragment_tokens);
      document.getElementById("s-reuse-ratio").textContent = "recompute ratio " + (s.recompute_ratio === null ? "–" : S.percent(s.recompute_ratio, 1)) +
        " (" + S.number(s.recomputed_tokens) + " fragment tokens recomputed)";
      document.getElementById("s-per-token").textContent = S.seconds(s.prefill_seconds_per_token);
      document.getElementById("s-saved").textContent = S.seconds(s.saved_seconds);
      document.getElementById("node-errors").replaceChildren(...answer.nodes.filter((n) => n.error).map((n) =>
        S.el("li", { class: "critical" }, n.node + ": " + n.error)));
      render();
      const current = requests.find((t) => key(t) === selected);
      if (current) show(current);
    } catch (err) {
      document.getElementById("node-errors").replaceChildren(S.el("li", { class: "critical" }, "Requests unavailable: " + err.message));
    }
  }

  function schedule() {
    clearInterval(timer);
    const every = Number(form.auto.value);
    if (every) timer = setInterval(load, every * 1000);
  }

  form.addEventListener("submit", (e) => { e.preventDefault(); load(); });
  form.node.addEventListener("change", load);
  form.auto.addEventListener("change", schedule);
  S.tierSwatches(document.getElementById("legend"));
  S.apiAll("/api/v1/nodes/").then((nodes) => nodes.forEach((n) => form.node.appendChild(S.el("option", { value: n.name }, n.name)))).catch(() => {});
  load();
  schedule();
})();
