// Live nodes table: load the REST snapshot, then apply websocket events; reconnect with backoff.
(function () {
  "use strict";
  const nodes = new Map();
  const tbody = document.querySelector("#nodes tbody");
  const stateEl = document.getElementById("stream-state");
  const seqEl = document.getElementById("last-seq");
  const eventsEl = document.getElementById("events");
  let lastSeq = 0;
  let backoff = 500;

  function human(bytes) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let value = bytes, i = 0;
    while (value >= 1024 && i < units.length - 1) { value /= 1024; i += 1; }
    return value.toFixed(value < 10 && i ? 1 : 0) + " " + units[i];
  }

  function tierCell(node, name) {
    const td = document.createElement("td");
    const tier = (node.tiers || []).find((t) => t.tier === name);
    if (!tier) { td.textContent = "–"; return td; }
    const pct = tier.capacity_bytes ? Math.min(100, (100 * tier.used_bytes) / tier.capacity_bytes) : 0;
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.setAttribute("role", "img");
    bar.setAttribute("aria-label", name + " " + pct.toFixed(0) + "% used");
    const fill = document.createElement("span");
    fill.style.width = pct.toFixed(1) + "%";
    bar.appendChild(fill);
    td.appendChild(bar);
    td.appendChild(document.createTextNode(human(tier.used_bytes) + " / " + human(tier.capacity_bytes)));
    return td;
  }

  function render() {
    tbody.replaceChildren();
    [...nodes.values()].sort((a, b) => a.name.localeCompare(b.name)).forEach((node) => {
      const tr = document.createElement("tr");
      tr.dataset.node = node.name;
      const name = document.createElement("th");
      name.scope = "row";
      name.textContent = node.name;
      const state = document.createElement("td");
      state.textContent = node.state;
      state.className = "state-" + node.state;
      state.dataset.field = "state";
      const seen = document.createElement("td");
      seen.textContent = new Date(node.last_seen).toLocaleTimeString();
      seen.dataset.field = "last_seen";
      tr.append(name, state, seen, tierCell(node, "device"), tierCell(node, "host"), tierCell(node, "disk"), tierCell(node, "remote"));
      tbody.appendChild(tr);
    });
  }

  function logEvent(event) {
    const li = document.createElement("li");
    li.textContent = "#" + event.seq + " " + event.type + " " + (event.payload.name || "");
    eventsEl.prepend(li);
    while (eventsEl.children.length > 20) eventsEl.lastChild.remove();
  }

  async function loadSnapshot() {
    let url = "/api/v1/nodes/";
    nodes.clear();
    while (url) {
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (!response.ok) throw new Error("snapshot " + response.status);
      const page = await response.json();
      page.results.forEach((node) => nodes.set(node.name, node));
      url = page.next;
    }
    render();
  }

  function apply(event) {
    if (typeof event.seq !== "number") return;
    lastSeq = Math.max(lastSeq, event.seq);
    seqEl.textContent = "#" + lastSeq;
    if (event.type === "node.heartbeat") {
      nodes.set(event.payload.name, event.payload);
    } else if (event.type === "node.state") {
      const node = nodes.get(event.payload.name);
      if (node) node.state = event.payload.state;
    }
    logEvent(event);
    render();
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + "/ws/dashboard/");
    socket.onopen = async () => {
      backoff = 500;
      stateEl.textContent = "live";
      try { await loadSnapshot(); } catch (err) { stateEl.textContent = "snapshot failed: " + err.message; }
    };
    socket.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (event.type === "hello" || event.type === "pong") return;
      apply(event);
    };
    socket.onclose = () => {
      stateEl.textContent = "reconnecting in " + (backoff / 1000).toFixed(1) + " s";
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 10000);
    };
  }

  connect();
})();
