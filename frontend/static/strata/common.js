// Helpers every dashboard page uses: formatting, the JSON API (with the CSRF token), small DOM builders.
(function () {
  "use strict";
  const TIERS = ["device", "host", "disk", "remote"];

  function bytes(value) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let v = Number(value), i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return v.toFixed(Math.abs(v) < 10 && i ? 1 : 0) + " " + units[i];
  }

  function seconds(value) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    const v = Number(value);
    if (Math.abs(v) < 0.001) return (v * 1e6).toFixed(0) + " µs";
    if (Math.abs(v) < 1) return (v * 1000).toFixed(1) + " ms";
    if (Math.abs(v) < 120) return v.toFixed(2) + " s";
    return (v / 60).toFixed(1) + " min";
  }

  function number(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 0 : digits });
  }

  function percent(part, whole) {
    if (!whole) return "–";
    return (100 * part / whole).toFixed(1) + "%";
  }

  function age(iso) {
    if (!iso) return "–";
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (s < 90) return s.toFixed(0) + " s ago";
    if (s < 5400) return (s / 60).toFixed(0) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }

  function csrfToken() {
    const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }

  class ApiError extends Error {
    constructor(status, body) {
      super(ApiError.describe(status, body));
      this.status = status;
      this.body = body;
    }

    static describe(status, body) {
      if (body && typeof body === "object") {
        if (body.detail) return String(body.detail);
        const parts = [];
        Object.entries(body).forEach(([field, problems]) => {
          parts.push(field + ": " + (Array.isArray(problems) ? problems.join(" ") : JSON.stringify(problems)));
        });
        if (parts.length) return parts.join("; ");
      }
      return "HTTP " + status;
    }
  }

  async function api(path, options) {
    const opts = Object.assign({ method: "GET" }, options || {});
    const headers = { Accept: "application/json" };
    if (opts.body !== undefined) {
      headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(opts.body);
    }
    if (opts.method !== "GET") headers["X-CSRFToken"] = csrfToken();
    const response = await fetch(path, Object.assign(opts, { headers, credentials: "same-origin" }));
    const text = await response.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (err) { body = { detail: text.slice(0, 200) }; }
    if (!response.ok) throw new ApiError(response.status, body);
    return body;
  }

  // All pages of a cursor-paginated list (stops after `limit` items).
  async function apiAll(path, limit) {
    const items = [];
    let url = path;
    while (url && items.length < (limit || 10000)) {
      const page = await api(url);
      if (Array.isArray(page)) return page;
      items.push(...(page.results || []));
      url = page.next;
    }
    return items;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    Object.entries(attrs || {}).forEach(([key, value]) => {
      if (value === null || value === undefined || value === false) return;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    });
    children.flat().forEach((child) => {
      if (child === null || child === undefined) return;
      node.appendChild(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
    });
    return node;
  }

  function occupancyBar(used, capacity, label, highWatermark) {
    const pct = capacity ? Math.min(100, (100 * used) / capacity) : 0;
    const bar = el("span", { class: "bar", role: "img", "aria-label": label + " " + pct.toFixed(0) + "% used" });
    bar.appendChild(el("span", { style: "width:" + pct.toFixed(1) + "%" }));
    if (highWatermark) bar.appendChild(el("i", { style: "left:" + (100 * highWatermark).toFixed(1) + "%", title: "high watermark" }));
    return bar;
  }

  // Marks each field named in a 400 answer as invalid and shows its message beside it.
  function showFieldErrors(form, error) {
    form.querySelectorAll(".field-error").forEach((node) => { node.textContent = ""; });
    form.querySelectorAll("[aria-invalid]").forEach((node) => node.removeAttribute("aria-invalid"));
    const body = error && error.body;
    const unplaced = [];
    if (body && typeof body === "object" && !body.detail) {
      Object.entries(body).forEach(([field, problems]) => {
        const message = Array.isArray(problems) ? problems.join(" ") : (typeof problems === "object" ? JSON.stringify(problems) : String(problems));
        const input = form.querySelector('[name="' + field + '"]');
        const slot = form.querySelector('[data-error-for="' + field + '"]');
        if (input) input.setAttribute("aria-invalid", "true");
        if (slot) slot.textContent = message;
        else unplaced.push(field + ": " + message);
      });
    } else if (error) {
      unplaced.push(error.message);
    }
    const summary = form.querySelector(".form-error");
    if (summary) summary.textContent = unplaced.join("; ");
    const first = form.querySelector('[aria-invalid="true"]');
    if (first) first.focus();
  }

  function clearFieldErrors(form) { showFieldErrors(form, null); }

  function tierSwatches(container) {
    container.replaceChildren(...TIERS.map((tier) => el("span", { style: "--swatch: var(--tier-" + tier + ")" }, tier)));
  }

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || "#888";
  }

  window.Strata = Object.assign(window.Strata || {}, {
    TIERS, bytes, seconds, number, percent, age, api, apiAll, ApiError, el, occupancyBar,
    showFieldErrors, clearFieldErrors, tierSwatches, cssVar,
    canEdit: () => document.body.dataset.canEdit === "true",
  });
})();
