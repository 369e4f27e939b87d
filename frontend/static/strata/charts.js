// Rolling time-series charts on uPlot (served from this site, installed from npm): follow the
// container's width and the light/dark theme; each chart also has a text summary for screen readers.
(function () {
  "use strict";

  function timeChart(container, options) {
    const maxPoints = options.points || 300;
    const data = [[], ...options.series.map(() => [])];
    let plot = null;

    function make() {
      if (plot) plot.destroy();
      const fg = Strata.cssVar("--fg"), line = Strata.cssVar("--line");
      const axis = { stroke: fg, grid: { stroke: line, width: 1 }, ticks: { stroke: line } };
      plot = new uPlot({
        width: Math.max(300, container.clientWidth - 4),
        height: options.height || 220,
        title: options.title,
        scales: { x: { time: true }, y: options.yRange ? { range: options.yRange } : { auto: true } },
        axes: [Object.assign({}, axis), Object.assign({}, axis, { values: (u, ticks) => ticks.map(options.format || String), size: 70 })],
        series: [{}, ...options.series.map((s) => ({
          label: s.label, stroke: Strata.cssVar(s.color), width: 2,
          fill: s.fill ? Strata.cssVar(s.color) + "33" : undefined,
          value: (u, v) => (v === null || v === undefined ? "–" : (options.format || String)(v)),
          paths: options.bars ? uPlot.paths.bars({ size: [0.8, 30] }) : undefined,
        }))],
      }, data, container);
    }

    function push(values, at) {
      data[0].push((at || Date.now()) / 1000);
      values.forEach((v, i) => data[i + 1].push(v));
      if (data[0].length > maxPoints) data.forEach((column) => column.shift());
      plot.setData(data);
      if (options.summary) options.summary.textContent = options.describe ? options.describe(values) : "";
    }

    function replace(xs, columns) {
      data[0] = xs.slice();
      columns.forEach((c, i) => { data[i + 1] = c.slice(); });
      plot.setData(data);
    }

    make();
    document.addEventListener("strata:theme", make);
    let width = container.clientWidth;
    new ResizeObserver(() => {
      if (Math.abs(container.clientWidth - width) > 8) { width = container.clientWidth; plot.setSize({ width: Math.max(300, width - 4), height: options.height || 220 }); }
    }).observe(container);
    return { push, replace, data };
  }

  window.Strata = Object.assign(window.Strata || {}, { timeChart });
})();
