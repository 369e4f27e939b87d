// Blocks: find by fingerprint or list by namespace (hottest, coldest, ...); a block's copies and its
// movement history.
(function () {
  "use strict";
  const S = window.Strata;
  const tbody = document.querySelector("#block-table tbody");
  const status = document.getElementById("result-status");
  const more = document.getElementById("more");
  let nextUrl = null;

  function short(key) { return key ? key.slice(0, 8) + "…" + key.slice(-4) : "–"; }
  function when(iso) { return iso ? new Date(iso).toLocaleString() : "–"; }

  function row(b) {
    const open = S.el("button", { type: "button", class: "link", "aria-label": "Show block " + b.id, onclick: () => show(b.id) }, "#" + b.id);
    return S.el("tr", { "data-block": b.id },
      S.el("th", { scope: "row" }, open), S.el("td", {}, b.namespace), S.el("td", {}, b.model),
      S.el("td", { class: "mono", title: b.prefix_key }, short(b.prefix_key)),
      S.el("td", { class: "num" }, S.number(b.position)), S.el("td", { class: "num" }, S.number(b.token_count)),
      S.el("td", { class: "num" }, S.bytes(b.size_bytes)), S.el("td", {}, b.priority),
      S.el("td", { class: "num" }, S.number(b.access_count)), S.el("td", {}, S.age(b.last_access_at)));
  }

  function showRows(blocks, append) {
    const rows = blocks.map(row);
    if (append) tbody.append(...rows); else tbody.replaceChildren(...rows);
    status.textContent = tbody.children.length ? tbody.children.length + " block(s) shown." : "No block matches.";
  }

  document.getElementById("search-key").addEventListener("submit", async (e) => {
    e.preventDefault();
    const form = e.currentTarget;
    S.clearFieldErrors(form);
    const key = form.key.value.trim();
    if (!key) { S.showFieldErrors(form, { body: { key: ["Enter a prefix key or content key."] } }); return; }
    try {
      const answer = await S.api("/api/v1/dashboard/blocks/?key=" + encodeURIComponent(key));
      nextUrl = null; more.hidden = true;
      showRows(answer.results, false);
      if (answer.results.length === 1) show(answer.results[0].id);
    } catch (err) { S.showFieldErrors(form, err); }
  });

  async function list(url, append) {
    const page = await S.api(url);
    nextUrl = page.next;
    more.hidden = !nextUrl;
    showRows(page.results, append);
  }

  document.getElementById("search-list").addEventListener("submit", async (e) => {
    e.preventDefault();
    const form = e.currentTarget;
    S.clearFieldErrors(form);
    const params = new URLSearchParams({ page_size: "50" });
    ["namespace", "ordering", "tier", "node", "state"].forEach((name) => { if (form[name].value) params.set(name, form[name].value); });
    try { await list("/api/v1/blocks/?" + params, false); } catch (err) { S.showFieldErrors(form, err); }
  });
  more.addEventListener("click", () => nextUrl && list(nextUrl, true).catch((err) => { status.textContent = err.message; }));

  async function show(id) {
    const section = document.getElementById("detail");
    tbody.querySelectorAll("tr").forEach((tr) => tr.classList.toggle("selected", tr.dataset.block === String(id)));
    const b = await S.api("/api/v1/blocks/" + id + "/");
    section.hidden = false;
    document.getElementById("detail-h").textContent = "Block #" + b.id;
    const fields = [["Namespace", b.namespace], ["Model", b.model], ["Prefix key", b.prefix_key], ["Content key", b.content_key],
      ["Position", S.number(b.position)], ["Tokens", S.number(b.token_count)], ["Size", S.bytes(b.size_bytes)],
      ["Priority", b.priority], ["Accesses", S.number(b.access_count)], ["Created", when(b.created_at)], ["Last access", when(b.last_access_at)]];
    document.getElementById("detail-fields").replaceChildren(...fields.map(([k, v]) => S.el("div", { class: "card" },
      S.el("dt", { class: "label" }, k), S.el("dd", { class: "mono", style: "margin:0;word-break:break-all" }, v))));
    document.querySelector("#placements tbody").replaceChildren(...b.placements.map((p) => S.el("tr", { "data-tier": p.tier },
      S.el("td", {}, p.tier), S.el("td", {}, p.node || "shared"), S.el("td", { class: "state-" + p.state }, p.state),
      S.el("td", { class: "num" }, S.bytes(p.size_bytes)), S.el("td", { class: "mono" }, p.checksum ? p.checksum.slice(0, 12) + "…" : "–"),
      S.el("td", { class: "num" }, p.epoch), S.el("td", { class: "mono" }, p.locator || "(from key)"), S.el("td", {}, when(p.updated_at)))));
    loadHistory(b.id);
    section.focus && section.scrollIntoView({ block: "nearest" });
  }

  async function loadHistory(id) {
    const historyStatus = document.getElementById("history-status");
    const body = document.querySelector("#history tbody");
    try {
      const movements = await S.apiAll("/api/v1/movements/?block=" + id, 200);
      body.replaceChildren(...movements.map((m) => S.el("tr", {},
        S.el("td", {}, "#" + m.id), S.el("td", {}, m.kind),
        S.el("td", {}, m.src_tier + (m.src_node ? "@" + m.src_node : "")),
        S.el("td", {}, m.dst_tier ? m.dst_tier + (m.dst_node ? "@" + m.dst_node : "") : "(freed)"),
        S.el("td", {}, m.reason), S.el("td", { class: "state-" + m.state }, m.state),
        S.el("td", {}, when(m.created_at)), S.el("td", {}, when(m.finished_at)), S.el("td", {}, m.error || m.detail || ""))));
      historyStatus.textContent = movements.length ? movements.length + " movement(s)." : "This block has never moved.";
    } catch (err) {
      body.replaceChildren();
      historyStatus.textContent = "Movement history unavailable: " + err.message;
    }
  }

  async function fillChoices() {
    try {
      const [namespaces, nodes] = await Promise.all([S.apiAll("/api/v1/namespaces/"), S.apiAll("/api/v1/nodes/")]);
      const nsSelect = document.getElementById("namespace");
      namespaces.forEach((ns) => nsSelect.appendChild(S.el("option", { value: ns.name }, ns.name)));
      const nodeSelect = document.getElementById("node");
      nodes.forEach((n) => nodeSelect.appendChild(S.el("option", { value: n.name }, n.name)));
    } catch (err) { status.textContent = "Could not load namespaces and nodes: " + err.message; }
    const params = new URLSearchParams(location.search);
    if (params.get("key")) { document.getElementById("key").value = params.get("key"); document.getElementById("search-key").requestSubmit(); }
    else if (params.get("block")) show(params.get("block"));
    else document.getElementById("search-list").requestSubmit();
  }
  fillChoices();
})();
