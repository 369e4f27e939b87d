// Light or dark: the operator's choice (kept in this browser), else the system's. Runs before the
// page paints so it never flashes the wrong theme.
(function () {
  "use strict";
  const KEY = "strata-theme";
  const root = document.documentElement;
  const stored = localStorage.getItem(KEY);
  if (stored === "light" || stored === "dark") root.dataset.theme = stored;

  function effective() {
    if (root.dataset.theme) return root.dataset.theme;
    return window.matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
  }

  function label(button) {
    const dark = effective() === "dark";
    button.setAttribute("aria-pressed", String(dark));
    button.textContent = dark ? "Light theme" : "Dark theme";
  }

  document.addEventListener("DOMContentLoaded", () => {
    const button = document.getElementById("theme-toggle");
    if (!button) return;
    label(button);
    button.addEventListener("click", () => {
      root.dataset.theme = effective() === "dark" ? "light" : "dark";
      localStorage.setItem(KEY, root.dataset.theme);
      label(button);
      document.dispatchEvent(new CustomEvent("strata:theme"));
    });
  });
})();
