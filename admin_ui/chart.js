// Time-series line charts drawn by uPlot (vendor/uPlot.iife.min.js, loaded before app.js).
// A chart follows its container's width, so it fits a phone as well as a desktop.

const COLORS = [
  "#2f5bd3",
  "#d9822b",
  "#1c7c4a",
  "#9b3fbf",
  "#c62f2f",
  "#0f8b8d",
  "#7a6a00",
  "#5b6475",
];
const HEIGHT = 240;
// Tick steps for counts: whole numbers only (1, 2, 5, 10, 20, 50, ...).
const DECADES = [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9];
const WHOLE_STEPS = DECADES.flatMap((decade) => [decade, 2 * decade, 5 * decade]);

export class TimeChart {
  constructor(container) {
    this.container = container;
    this.plot = null;
    this.layout = ""; // the series' labels and scales the plot was built for
    this.span = null; // [from, to] in Unix seconds, the x axis's range
    new ResizeObserver(() => this.fit()).observe(container);
  }

  /**
   * Draw `times` (Unix seconds) against each series [{label, values, scale?}] over `span`
   * ([from, to] seconds): the axis covers the whole window even when the data starts late.
   */
  show(times, series, span) {
    this.span = span;
    const data = [times, ...series.map((line) => line.values)];
    const layout = series.map((line) => `${line.label}/${line.scale ?? "y"}`).join("\n");
    if (this.plot && layout === this.layout) {
      this.plot.setData(data);
      return;
    }
    // uPlot's series are fixed when it is built: other series mean another plot.
    this.plot?.destroy();
    this.layout = layout;
    this.plot = new window.uPlot(this.options(series), data, this.container);
  }

  options(series) {
    const scales = [...new Set(series.map((line) => line.scale ?? "y"))];
    const fromZero = { range: (_u, _min, max) => [0, Math.max(1, max ?? 0)] };
    return {
      width: this.width(),
      height: HEIGHT,
      legend: { live: false },
      scales: {
        x: { time: true, range: (_u, min, max) => this.span ?? [min, max] },
        ...Object.fromEntries(scales.map((scale) => [scale, fromZero])),
      },
      series: [
        {},
        ...series.map((line, i) => ({
          label: line.label,
          scale: line.scale ?? "y",
          stroke: COLORS[i % COLORS.length],
          width: 2,
        })),
      ],
      axes: [
        {},
        ...scales.map((scale, i) => ({
          scale,
          side: i === 0 ? 3 : 1, // the first on the left, a second on the right
          grid: { show: i === 0 },
          incrs: WHOLE_STEPS,
          size: 56,
        })),
      ],
    };
  }

  width() {
    return Math.max(200, this.container.clientWidth);
  }

  // Only the width is followed: the plot sets its own height, so following both would loop.
  fit() {
    if (this.plot && this.container.clientWidth > 0) {
      this.plot.setSize({ width: this.width(), height: HEIGHT });
    }
  }
}
