// Movements: in flight and history (live), "run migration now", and the beat crontabs that switch modes.
(function () {
  "use strict";
  const S = window.Strata;
  const canEdit = S.canEdit();
  const notice = document.getElementById("notice");
  const historyForm = document.getElementById("history-form");
  const more = document.getElementById("more");
  let nextUrl = null;

  function say(text, good) { notice.replaceChildren(S.el("p", { class: "notice " + (good ? "good" : "bad") }, text)); }
  function when(iso) { return iso ? new Date(iso).toLocaleString() : "–"; }
  function blockLink(m) { return S.el("a", { href: "/blocks/?block=" + m.block }, "#" + m.block); }

  function flightRow(m) {
    return S.el("tr", { "data-movement": m.id, "data-state": m.state },
      S.el("th", { scope: "row" }, "#" + m.id), S.el("td", {}, blockLink(m)), S.el("td", {}, m.kind), S.el("td", {}, m.route),
      S.el("td", {}, m.exec_node), S.el("td", {}, m.reason), S.el("td", { class: "state-" + m.state }, m.state),
      S.el("td", { class: "num" }, S.bytes(m.bytes)), S.el("td", {}, S.age(m.started_at || m.dispatched_at || m.created_at)));
  }

  function historyRow(m) {
    return S.el("tr", { "data-movement": m.id, "data-state": m.state },
      S.el("th", { scope: "row" }, "#" + m.id), S.el("td", {}, blockLink(m)), S.el("td", {}, m.kind), S.el("td", {}, m.route),
      S.el("td", {}, m.exec_node), S.el("td", {}, m.reason), S.el("td", { class: "state-" + m.state }, m.state),
      S.el("td", { class: "num" }, S.bytes(m.bytes)), S.el("td", { class: "num" }, S.seconds(m.duration_s)),
      S.el("td", {}, when(m.finished_at)), S.el("td", {}, m.error || m.detail || ""));
  }

  async function loadFlight() {
    const states = ["running", "dispatched", "planned"];
    const pages = await Promise.all(states.map((s) => S.api("/api/v1/movements/?page_size=100&state=" + s)));
    const rows = pages.flatMap((p) => p.results).map(flightRow);
    document.querySelector("#flight-table tbody").replaceChildren(...(rows.length ? rows
      : [S.el("tr", {}, S.el("td", { colspan: 9 }, "Nothing in flight."))]));
  }

  async function loadHistory(url, append) {
    const page = await S.api(url);
    nextUrl = page.next;
    more.hidden = !nextUrl;
    const body = document.querySelector("#history-table tbody");
    const rows = page.results.map(historyRow);
    if (append) body.append(...rows);
    else body.replaceChildren(...(rows.length ? rows : [S.el("tr", {}, S.el("td", { colspan: 11 }, "No movement matches."))]));
  }

  function historyUrl() {
    const params = new URLSearchParams({ page_size: "50" });
    ["state", "kind", "reason", "node", "src_tier"].forEach((n) => { if (historyForm.elements[n].value) params.set(n, historyForm.elements[n].value); });
    return "/api/v1/movements/?" + params;
  }

  historyForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    S.clearFieldErrors(historyForm);
    try { await loadHistory(historyUrl(), false); } catch (err) { S.showFieldErrors(historyForm, err); }
  });
  more.addEventListener("click", () => nextUrl && loadHistory(nextUrl, true).catch((err) => say(err.message, false)));

  // -- run now ----------------------------------------------------------------------------------
  const runForm = document.getElementById("run-form");
  if (runForm) {
    runForm.addEventListener("submit", async (e) => {
      e.preventDefault();
      S.clearFieldErrors(runForm);
      const body = { node: runForm.elements.node.value || null, dry_run: runForm.elements.dry_run.checked };
      try {
        const r = await S.api("/api/v1/movements/run/", { method: "POST", body });
        document.getElementById("run-result").replaceChildren(S.el("p", { class: "notice good", "data-field": "run-summary" },
          (r.dry_run ? "Would move " : "Planned ") + S.number(r.moves) + " move(s), " + S.bytes(r.bytes_moved) + ", and " +
          S.number(r.evictions) + " eviction(s), " + S.bytes(r.bytes_evicted) + " under policy version " + r.policy_version +
          (r.mode ? " (mode " + r.mode + ")" : "") + "."));
        refresh();
      } catch (err) {
        S.showFieldErrors(runForm, err);
        say("Not run: " + err.message, false);
      }
    });
  }

  // -- schedules --------------------------------------------------------------------------------
  async function loadSchedules() {
    const [schedules, modes] = await Promise.all([S.apiAll("/api/v1/mode-schedules/"), S.apiAll("/api/v1/modes/")]);
    document.querySelector("#schedule-table tbody").replaceChildren(...(schedules.length ? schedules.map((s) => S.el("tr", { "data-schedule": s.id },
      S.el("th", { scope: "row" }, s.mode), S.el("td", { class: "mono" }, s.cron), S.el("td", {}, s.enabled ? "yes" : "no"),
      S.el("td", { class: "mono" }, s.beat_entry || "–"), S.el("td", {}, s.author || "–"),
      canEdit ? S.el("td", {},
        S.el("button", { type: "button", "aria-label": (s.enabled ? "Disable" : "Enable") + " the " + s.mode + " schedule", onclick: () => toggle(s) }, s.enabled ? "Disable" : "Enable"), " ",
        S.el("button", { type: "button", class: "danger", "aria-label": "Delete the " + s.mode + " schedule", onclick: () => remove(s) }, "Delete")) : null))
      : [S.el("tr", {}, S.el("td", { colspan: canEdit ? 6 : 5 }, "No schedule."))]));
    const select = document.getElementById("s-mode");
    if (select && !select.options.length) modes.forEach((m) => select.appendChild(S.el("option", { value: m.name }, m.name)));
    const active = modes.find((m) => m.active);
    document.getElementById("mode").textContent = active ? active.name : "none";
  }

  async function toggle(s) {
    try { await S.api("/api/v1/mode-schedules/" + s.id + "/", { method: "PATCH", body: { enabled: !s.enabled } }); await loadSchedules(); }
    catch (err) { say("Not changed: " + err.message, false); }
  }

  async function remove(s) {
    if (!window.confirm("Delete the " + s.mode + " schedule (" + s.cron + ")?")) return;
    try { await S.api("/api/v1/mode-schedules/" + s.id + "/", { method: "DELETE" }); await loadSchedules(); }
    catch (err) { say("Not deleted: " + err.message, false); }
  }

  const scheduleForm = document.getElementById("schedule-form");
  if (scheduleForm) {
    scheduleForm.addEventListener("submit", async (e) => {
      e.preventDefault();
      S.clearFieldErrors(scheduleForm);
      const body = { mode: scheduleForm.elements.mode.value, cron: scheduleForm.elements.cron.value.trim(), enabled: scheduleForm.elements.enabled.checked };
      try { await S.api("/api/v1/mode-schedules/", { method: "POST", body }); say("Schedule added.", true); scheduleForm.elements.cron.value = ""; await loadSchedules(); }
      catch (err) { S.showFieldErrors(scheduleForm, err); say("Not added: " + err.message, false); }
    });
  }

  // -- live -------------------------------------------------------------------------------------
  let timer = null;
  function refresh() {
    clearTimeout(timer);
    timer = setTimeout(() => Promise.all([loadFlight(), loadHistory(historyUrl(), false)]).catch((err) => say("Reload failed: " + err.message, false)), 150);
  }

  async function snapshot() {
    const overview = await S.api("/api/v1/dashboard/overview/");
    await Promise.all([loadFlight(), loadHistory(historyUrl(), false), loadSchedules()]);
    return overview.seq;
  }

  S.apiAll("/api/v1/nodes/").then((nodes) => nodes.forEach((n) => {
    historyForm.elements.node.appendChild(S.el("option", { value: n.name }, n.name));
    if (runForm) runForm.elements.node.appendChild(S.el("option", { value: n.name }, n.name));
  })).catch(() => {});

  S.live({
    snapshot,
    apply: (event) => {
      if (event.type.startsWith("movement.")) refresh();
      else if (event.type === "mode.switched") loadSchedules().catch(() => {});
    },
  });
})();
