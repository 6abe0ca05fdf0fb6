/* tapescope report page.
 *
 * Reads the profile digest from <script id="tapescope-data" type="application/json"> and builds the
 * page. Every string in it (model, module, op and file names) comes from user code, so data only
 * ever reaches the DOM as text (textContent, Text nodes, attributes): never as markup.
 */
(function () {
  "use strict";

  const D = JSON.parse(document.getElementById("tapescope-data").textContent);
  const OPS = D.ops;
  const CAT_COLOR = Object.fromEntries(D.categories.map((c) => [c.name, c.color]));

  // ---- helpers ------------------------------------------------------------------------------

  function el(tag, props, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v == null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k === "onclick") e.addEventListener("click", v);
      else if (k === "color") e.style.background = v;
      else e.setAttribute(k, v);
    }
    for (const kid of kids) if (kid != null) e.append(kid); // strings become Text nodes
    return e;
  }

  const BYTE_UNITS = [["EiB", 2 ** 60], ["PiB", 2 ** 50], ["TiB", 2 ** 40], ["GiB", 2 ** 30],
                      ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

  function fmtBytes(n) {
    if (n == null) return "–";
    if (typeof n !== "number") return String(n);
    const a = Math.abs(n);
    for (const [unit, size] of BYTE_UNITS) {
      if (a >= size) return (n / size).toFixed(2) + " " + unit;
    }
    return n + " B";
  }

  const BYTE_INCRS = Array.from({ length: 63 }, (_, e) => 2 ** e);

  function fmtAxisBytes(n) {
    for (const [unit, size] of BYTE_UNITS) {
      if (Math.abs(n) >= size) return +(n / size).toFixed(2) + " " + unit;
    }
    return n + " B";
  }

  function fmtFlops(n) {
    if (n == null) return "–";
    if (typeof n !== "number") return String(n);
    const a = Math.abs(n);
    for (const [unit, size] of [["PFLOP", 1e15], ["TFLOP", 1e12], ["GFLOP", 1e9], ["MFLOP", 1e6], ["kFLOP", 1e3]]) {
      if (a >= size) return (n / size).toFixed(2) + " " + unit;
    }
    return n + " FLOP";
  }

  function fmtTime(s) {
    if (s == null) return "–";
    if (typeof s !== "number") return String(s);
    const a = Math.abs(s);
    if (a >= 1) return s.toFixed(3) + " s";
    if (a >= 1e-3) return (s * 1e3).toFixed(3) + " ms";
    return (s * 1e6).toFixed(2) + " µs";
  }

  function fmtCount(n) {
    if (typeof n !== "number") return n == null ? "–" : String(n);
    if (n >= 1e9) return (n / 1e9).toFixed(2) + "B";
    if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (n >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return String(n);
  }

  const pct = (a, b) => (typeof a === "number" && typeof b === "number" && b ? (100 * a / b).toFixed(1) + "%" : "");
  const opName = (i) => OPS.names[OPS.name[i]];
  const opModule = (i) => OPS.modules[OPS.module[i]];
  const opLabel = (i) => (i == null ? "before the step" : "#" + i + " " + opName(i));
  const modLabel = (m) => (m == null ? "–" : m === "" ? "(root)" : m);

  function phaseOf(i) {
    for (const [phase, start, end] of D.phases) if (i >= start && i < end) return phase;
    return null;
  }

  function phaseChip(phase) {
    return phase ? el("span", { class: "ph", color: D.phase_colors[phase] || "#888", text: phase }) : "";
  }

  function source(text) {
    if (!text) return el("span", { class: "muted", text: "–" });
    // "/long/path/file.py:91 in forward" -> "file.py:91 in forward", the full path on hover
    const short = text.replace(/^.*[\\/]/, "");
    return el("span", { title: text, text: short });
  }

  function table(tableEl, columns, rows) {
    tableEl.replaceChildren();
    const head = el("tr", null, ...columns.map((c) => el("th", { class: c.num ? "n" : null, text: c.label })));
    tableEl.append(el("thead", null, head));
    const body = el("tbody");
    for (const r of rows) {
      body.append(el("tr", null, ...columns.map((c) => {
        const v = c.get(r);
        return el("td", { class: c.num ? "n" : c.code ? "code" : null }, v);
      })));
    }
    tableEl.append(body);
    return body;
  }

  // ---- header -------------------------------------------------------------------------------

  function header() {
    const m = D.meta;
    document.getElementById("model").textContent = m.model;
    const facts = document.getElementById("facts");
    const add = (label, value, cls) => {
      if (value == null || value === "") return;
      facts.append(el("div", null, el("dt", { text: label }), el("dd", { class: cls, text: value })));
    };
    const inputs = m.inputs.map((i) => (i.shape ? i.shape.join("×") + " " + i.dtype : i.repr)).join(", ");
    add("Inputs", inputs || "–");
    add("Device", m.device);
    add("GPU", m.gpu);
    add("Precision", (m.dtype || "model dtype") + (m.amp ? " + autocast " + m.amp : ""));
    const opt = m.optimizer;
    add("Optimizer", opt ? opt.name + (opt.implementation ? " (" + opt.implementation + ")" : "") : "none");
    add("Parameters", fmtCount(m.parameters));
    if (m.steps === 2) {
      add("Peak, steady state (step 2)", fmtBytes(m.peak_bytes), "big");
      add("Peak, first step", fmtBytes(m.first_step_peak_bytes));
    } else {
      add("Peak, first step", fmtBytes(m.peak_bytes), "big");
    }
    const f = m.flops;
    add("FLOPs total", fmtFlops(f.total));
    add("FLOPs forward / backward / optimizer",
      [f.forward, f.backward, f.optimizer].map(fmtFlops).join(" / "));
    const c = m.ops_by_phase;
    const n = (k) => k.toLocaleString("en-US");
    add("Ops", n(m.n_ops) + " (" + n(c.forward) + " fwd, " + n(c.backward) + " bwd, " + n(c.optimizer) + " opt)");
    if (m.cuda_memory) {
      const cm = m.cuda_memory;
      add("max_memory_allocated / reserved", fmtBytes(cm.max_allocated) + " / " + fmtBytes(cm.max_reserved));
      add("nvidia-smi (about)", fmtBytes(cm.nvidia_smi) + " of " + fmtBytes(cm.capacity) + ": " +
        (cm.oom ? "does not fit" + (cm.oom_at ? " (" + cm.oom_at + ")" : "") : "fits"),
        cm.oom ? "bad" : null);
      if (cm.settings) add("Allocator settings", cm.settings);
      if (cm.stream_cached) add("Side streams' cache", fmtBytes(cm.stream_cached) +
        " of max_memory_reserved: blocks FSDP2's copy-in and reduce-scatter streams freed, " +
        "kept for their own stream");
    }
    if (m.time) {
      const t = m.time;
      add("Time estimate", fmtTime(t.seconds) + (t.bound ? ", " + t.bound + "-bound" : "") +
        (t.mfu != null ? ", MFU " + (100 * t.mfu).toFixed(1) + "%" : "") +
        (t.calibration ? " (calibrated: " + t.calibration +
          (t.calibrated === false ? "; kernels of kinds it did not measure on the priors" : "") + ")"
          : t.calibrated === false ? " (timing constants not yet calibrated on a GPU)" : ""));
      if (t.error_band) add("Time error", t.error_band);
    }
    if (m.step2) add("Step 2", m.step2);
    add("Versions", "tapescope " + m.tapescope_version + " · torch " + m.torch_version);
    document.getElementById("footer").textContent =
      "Generated by tapescope " + m.tapescope_version + " with torch " + m.torch_version +
      ". Chart drawn with uPlot 1.6.32 (MIT license), embedded in this file: it works offline.";
  }

  // ---- memory chart -------------------------------------------------------------------------

  function chart() {
    const host = document.getElementById("chart");
    const T = D.timeline;
    const x = T.x;
    // with a time estimate (CUDA profiles) the x axis is time: each phase takes its share of
    // the step's time; else it is the op index
    const useTime = Array.isArray(T.t);
    const xs = useTime ? T.t : x;
    const phaseSpans = useTime ? T.phase_t : D.phases.map(([ph, a, b]) => [ph, a - 0.5, b - 0.5]);
    const cats = D.categories.filter((c) => T.series[c.name]);
    const peak = D.peak;
    const peakX = useTime ? T.peak_t : peak.op;
    host.dataset.axis = useTime ? "time" : "op";

    const legend = document.getElementById("legend");
    for (const c of D.categories) {
      const b = peak.at_peak[c.name];
      if (!T.series[c.name] && !b) continue;
      legend.append(el("span", null, el("i", { class: "sw", color: c.color }), c.name + " ",
        el("span", { class: "muted", text: fmtBytes(b) + " at peak" })));
    }
    const note = document.getElementById("chart-note");
    if (!x.length) {
      note.textContent = "The step ran no op.";
      return null;
    }
    note.textContent = x.length < T.n
      ? "Showing " + x.length.toLocaleString("en-US") + " of " + T.n.toLocaleString("en-US") +
        " ops: the lowest and highest op of each stretch, and the peak exactly."
      : "All " + T.n.toLocaleString("en-US") + " ops shown.";

    // Stacked areas as cumulative sums, painted top-down with opaque fills: each category covers
    // the part of the one above it that belongs to the categories below.
    const acc = new Float64Array(x.length);
    const cum = cats.map((c) => {
      const s = T.series[c.name];
      for (let i = 0; i < x.length; i++) acc[i] += typeof s[i] === "number" ? s[i] : 0;
      return Array.from(acc);
    });
    const order = cats.map((_, k) => k).reverse();
    const stepped = uPlot.paths.stepped({ align: 1 });
    const data = [xs, ...order.map((k) => cum[k])];
    const series = [{ label: "op" }, ...order.map((k) => ({
      label: cats[k].name, stroke: cats[k].color, fill: cats[k].color, width: 1,
      paths: stepped, points: { show: false },
    }))];

    const tip = el("div", { id: "tooltip", class: "tooltip", role: "tooltip" });
    tip.hidden = true;
    const marker = el("div", { id: "peak-marker", class: "peak-marker", title: "peak" });
    const markerLabel = el("div", { class: "peak-label",
      text: "peak " + fmtBytes(peak.bytes) + " · " + opLabel(peak.op) });
    const px = uPlot.pxRatio;

    function drawPhases(u, strip) {
      const ctx = u.ctx, b = u.bbox;
      ctx.save();
      ctx.beginPath();
      ctx.rect(b.left, b.top, b.width, b.height);
      ctx.clip();
      for (const [phase, start, end] of phaseSpans) {
        const x0 = u.valToPos(start, "x", true), x1 = u.valToPos(end, "x", true);
        if (x1 < b.left || x0 > b.left + b.width) continue;
        const color = D.phase_colors[phase] || "#888";
        if (!strip) {
          ctx.globalAlpha = 0.07;
          ctx.fillStyle = color;
          ctx.fillRect(x0, b.top, x1 - x0, b.height);
          continue;
        }
        const h = 16 * px;
        ctx.globalAlpha = 0.85;
        ctx.fillStyle = color;
        ctx.fillRect(x0, b.top, x1 - x0, h);
        ctx.globalAlpha = 1;
        ctx.strokeStyle = "rgba(0,0,0,.35)";
        ctx.setLineDash([3 * px, 3 * px]);
        ctx.beginPath();
        ctx.moveTo(Math.round(x0) + 0.5, b.top);
        ctx.lineTo(Math.round(x0) + 0.5, b.top + b.height);
        ctx.stroke();
        ctx.setLineDash([]);
        ctx.fillStyle = "#fff";
        ctx.font = "600 " + 11 * px + "px system-ui, sans-serif";
        ctx.textBaseline = "middle";
        ctx.textAlign = "left";
        const left = Math.max(x0, b.left);
        const w = Math.min(x1, b.left + b.width) - left;
        // a narrow band gets the short name, or none
        const label = [phase, phase.slice(0, 3)].find((t) => ctx.measureText(t).width + 8 * px < w);
        if (label) ctx.fillText(label, left + 4 * px, b.top + h / 2);
      }
      ctx.restore();
    }

    function placePeak(u) {
      const sx = u.scales.x;
      const visible = peak.op != null && peakX >= sx.min && peakX <= sx.max;
      marker.hidden = markerLabel.hidden = !visible;
      if (!visible) return;
      const left = u.valToPos(peakX, "x"), top = u.valToPos(peak.bytes, "y");
      marker.style.left = left + "px";
      marker.style.top = top + "px";
      // keep the label inside the plot: left of the marker when the peak is on the right half
      const onRight = left > u.over.clientWidth / 2;
      markerLabel.style.top = Math.max(18, top - 22) + "px";
      markerLabel.style.left = onRight ? "" : left + 10 + "px";
      markerLabel.style.right = onRight ? u.over.clientWidth - left + 10 + "px" : "";
      const ctx = u.ctx;
      const cx = u.valToPos(peakX, "x", true);
      ctx.save();
      ctx.strokeStyle = "#cf222e";
      ctx.lineWidth = 1.5 * px;
      ctx.setLineDash([4 * px, 3 * px]);
      ctx.beginPath();
      ctx.moveTo(cx, u.bbox.top);
      ctx.lineTo(cx, u.bbox.top + u.bbox.height);
      ctx.stroke();
      ctx.restore();
    }

    function showTip(u) {
      const i = u.cursor.idx;
      if (i == null || u.cursor.left < 0) {
        tip.hidden = true;
        return;
      }
      const op = x[i];
      const rows = [el("tr", { class: "total" }, el("td", { text: "live" }),
        el("td", { class: "n", text: fmtBytes(cum[cum.length - 1][i]) }))];
      for (let k = cats.length - 1; k >= 0; k--) {
        const v = T.series[cats[k].name][i];
        if (!v) continue;
        rows.push(el("tr", null, el("td", null, el("i", { class: "sw", color: cats[k].color }), cats[k].name),
          el("td", { class: "n", text: fmtBytes(v) })));
      }
      tip.replaceChildren(
        el("div", { class: "op", text: opLabel(op) }),
        el("div", { class: "sub" }, phaseChip(phaseOf(op)), " module " + modLabel(opModule(op))),
        el("table", null, el("tbody", null, ...rows)));
      tip.hidden = false;
      const W = u.over.clientWidth;
      const left = u.cursor.left, top = u.cursor.top;
      const tw = tip.offsetWidth, th = tip.offsetHeight;
      tip.style.left = (left + 14 + tw > W ? left - 14 - tw : left + 14) + "px";
      tip.style.top = Math.max(0, Math.min(top + 14, u.over.clientHeight - th)) + "px";
    }

    const opts = {
      width: Math.max(300, host.clientWidth),
      height: 380,
      legend: { show: false },
      cursor: { y: false, points: { show: false }, drag: { x: true, y: false } },
      scales: {
        x: { time: false, range: (u, lo, hi) => [lo, hi] },
        y: { range: (u, lo, hi) => [0, Math.max(1, hi) * 1.12] },
      },
      axes: [
        useTime
          ? { label: "estimated time (ms)", labelSize: 18, size: 34, values: (u, splits) => splits.map((v) => v.toLocaleString("en-US", { maximumFractionDigits: 3 })) }
          : { label: "op", labelSize: 18, size: 34, values: (u, splits) => splits.map((v) => (Number.isInteger(v) ? v.toLocaleString("en-US") : "")) },
        // powers of two: ticks at 256 KiB, 512 KiB, 768 KiB ... rather than 244.14 KiB
        { size: 78, incrs: BYTE_INCRS, values: (u, splits) => splits.map(fmtAxisBytes) },
      ],
      series,
      hooks: {
        drawClear: [(u) => drawPhases(u, false)],
        draw: [(u) => { drawPhases(u, true); placePeak(u); }],
        setCursor: [showTip],
      },
    };
    const u = new uPlot(opts, data, host);
    u.over.append(marker, markerLabel, tip);
    u.over.addEventListener("mouseleave", () => { tip.hidden = true; });
    window.addEventListener("resize", () => u.setSize({ width: Math.max(300, host.clientWidth), height: 380 }));
    return u;
  }

  // ---- the peak -----------------------------------------------------------------------------

  function peakSection() {
    const p = D.peak;
    const sum = document.getElementById("peak-summary");
    if (p.op == null) {
      sum.textContent = "No op ran.";
      return;
    }
    sum.append(el("b", { text: fmtBytes(p.bytes) }), " live while op ", el("b", { text: opLabel(p.op) }),
      " ran (", phaseChip(phaseOf(p.op)), " module " + modLabel(opModule(p.op)) + "). ",
      "Largest tensors alive there (repeats in instances of one block grouped):");
    table(document.getElementById("live-table"), [
      { label: "bytes", num: true, get: (t) => fmtBytes(t.bytes) + (t.count > 1 ? " \u00d7" + t.count : "") },
      { label: "share", num: true, get: (t) => pct(t.bytes * (t.count || 1), p.bytes) },
      { label: "category", get: (t) => el("span", null, el("i", { class: "sw", color: CAT_COLOR[t.category] }), t.category) },
      { label: "made by", code: true, get: (t) => (t.op == null ? el("span", { class: "muted", text: "before the step" }) : opLabel(t.op)) },
      { label: "module", code: true, get: (t) => modLabel(t.module) },
      { label: "source", code: true, get: (t) => source(t.source) },
      { label: "parameter", code: true, get: (t) => t.owner || "" },
    ], D.live);
  }

  // ---- module tree --------------------------------------------------------------------------

  function moduleSection() {
    const M = D.modules;
    const COL = Object.fromEntries(M.columns.map((c, k) => [c, k]));
    const columns = [
      { key: COL.module, label: "Module" },
      { key: COL.first_op, label: "First op", num: true, fmt: (v) => (v == null ? "–" : "#" + v) },
      { key: COL.parameters, label: "Parameters", num: true, fmt: fmtBytes },
      { key: COL.saved, label: "Saved activations", num: true, fmt: fmtBytes },
      { key: COL.peak, label: "Peak while running", num: true, fmt: fmtBytes },
      { key: COL.flops, label: "FLOPs", num: true, fmt: fmtFlops },
    ];
    if (M.has_time) columns.push({ key: COL.time_s, label: "Time (est.)", num: true, fmt: fmtTime });

    const nodes = new Map();
    for (const r of M.rows) nodes.set(r[COL.module], { fqn: r[COL.module], row: r, kids: [], depth: 0 });
    const root = nodes.get("");
    for (const n of nodes.values()) {
      if (n === root) continue;
      const dot = n.fqn.lastIndexOf(".");
      (nodes.get(dot < 0 ? "" : n.fqn.slice(0, dot)) || root).kids.push(n);
    }
    let maxDepth = 0;
    (function depth(n, d) {
      n.depth = d;
      maxDepth = Math.max(maxDepth, d);
      for (const k of n.kids) depth(k, d + 1);
    })(root, 0);

    const name = (n) => (n === root ? "(root) " + D.meta.model : n.fqn.slice(n.fqn.lastIndexOf(".") + 1));
    const collator = new Intl.Collator("en", { numeric: true });
    // execution order (first op) until a header is clicked
    const state = { col: COL.first_op, dir: 1, expanded: new Set([""]), limit: 1000 };

    function compare(a, b) {
      if (state.col === COL.module) return state.dir * collator.compare(name(a), name(b));
      const va = a.row[state.col], vb = b.row[state.col];
      const na = typeof va === "number", nb = typeof vb === "number";
      if (!na || !nb) return na === nb ? 0 : na ? -1 : 1; // missing values last either way
      return state.dir * (va - vb);
    }

    function visible() {
      const out = [];
      (function walk(n) {
        out.push(n);
        if (!state.expanded.has(n.fqn)) return;
        for (const k of n.kids.slice().sort(compare)) walk(k);
      })(root);
      return out;
    }

    const tableEl = document.getElementById("module-table");
    const headRow = el("tr");
    columns.forEach((c) => {
      const th = el("th", { class: "sortable" + (c.num ? " n" : ""), text: c.label, "data-col": c.label, scope: "col" });
      th.addEventListener("click", () => {
        if (state.col === c.key) state.dir = -state.dir;
        else {
          state.col = c.key;
          state.dir = c.num && c.key !== COL.first_op ? -1 : 1; // big numbers first; names A-Z
        }
        render();
      });
      headRow.append(th);
    });
    tableEl.append(el("thead", null, headRow));
    const body = el("tbody");
    tableEl.append(body);

    const controls = document.getElementById("module-controls");
    const chips = [];
    const depthChip = (label, d) => {
      const b = el("button", { class: "chip", type: "button", text: label, onclick: () => {
        state.expanded = new Set([...nodes.values()].filter((n) => n.depth < d).map((n) => n.fqn));
        render();
      } });
      chips.push(b);
      controls.append(b);
    };
    controls.append(el("span", { class: "muted", text: "open to depth" }));
    for (let d = 1; d <= Math.min(maxDepth, 4); d++) depthChip(String(d), d);
    if (maxDepth > 4) depthChip("all", Infinity);
    controls.append(el("span", { class: "muted", text: nodes.size.toLocaleString("en-US") + " modules" }));

    const more = document.getElementById("module-more");

    function render() {
      headRow.querySelectorAll("th").forEach((th, k) => {
        const key = columns[k].key;
        if (key === state.col) th.setAttribute("aria-sort", state.dir > 0 ? "ascending" : "descending");
        else th.removeAttribute("aria-sort");
      });
      const rows = visible();
      const frag = document.createDocumentFragment();
      for (const n of rows.slice(0, state.limit)) {
        const open = state.expanded.has(n.fqn);
        const toggle = n.kids.length
          ? el("button", { class: "toggle", type: "button", "aria-expanded": String(open),
            "aria-label": (open ? "close " : "open ") + n.fqn, text: open ? "▾" : "▸",
            onclick: () => {
              if (open) state.expanded.delete(n.fqn);
              else state.expanded.add(n.fqn);
              render();
            } })
          : el("span", { class: "leaf" });
        const cells = [el("td", { class: "code", title: n.fqn === "" ? "(root)" : n.fqn },
          el("span", { style: "padding-left:" + n.depth * 16 + "px" }), toggle, name(n),
          n.kids.length ? el("span", { class: "muted", text: " (" + n.kids.length + ")" }) : null)];
        for (const c of columns.slice(1)) {
          const v = n.row[c.key];
          const td = el("td", { class: "n", text: c.fmt(v) });
          if (typeof v === "number") td.dataset.value = String(v);
          cells.push(td);
        }
        const tr = el("tr", null, ...cells);
        tr.dataset.fqn = n.fqn;
        tr.dataset.depth = String(n.depth);
        frag.append(tr);
      }
      body.replaceChildren(frag);
      more.replaceChildren();
      if (rows.length > state.limit) {
        more.append(el("button", { class: "chip", type: "button",
          text: "show all " + rows.length.toLocaleString("en-US") + " open rows",
          onclick: () => { state.limit = Infinity; render(); } }));
      }
    }
    render();
  }

  // ---- forward -> backward map --------------------------------------------------------------

  function fwdSection() {
    const F = D.fwd_map;
    const tableEl = document.getElementById("fwd-table");
    const input = document.getElementById("fwd-filter");
    const count = document.getElementById("fwd-count");
    const more = document.getElementById("fwd-more");
    let limit = 200;
    let keys = null; // lower-case search text per row, built on the first filter

    const columns = [
      { label: "forward op", code: true, get: (r) => opLabel(r[0]) },
      { label: "module", code: true, get: (r) => modLabel(opModule(r[0])) },
      { label: "autograd node", code: true, get: (r) => F.nodes[r[1]] },
      { label: "backward ops", code: true, get: (r) => (r[2].length
        ? el("div", null, ...r[2].map((b) => el("div", { text: opLabel(b) })))
        : el("span", { class: "muted", text: "none (nothing to compute, or no gradient needed)" })) },
    ];

    function render() {
      const q = input.value.trim().toLowerCase();
      let rows = F.rows;
      if (q) {
        keys = keys || F.rows.map((r) => [opLabel(r[0]), modLabel(opModule(r[0])), F.nodes[r[1]],
          ...r[2].map(opName)].join(" ").toLowerCase());
        rows = F.rows.filter((_, k) => keys[k].includes(q));
      }
      count.textContent = rows.length.toLocaleString("en-US") + " forward ops with an autograd node" +
        (q ? " match" : "") + (rows.length > limit ? "; first " + limit + " shown" : "");
      table(tableEl, columns, rows.slice(0, limit));
      more.replaceChildren();
      if (rows.length > limit) {
        more.append(el("button", { class: "chip", type: "button", text: "show more",
          onclick: () => { limit += 1000; render(); } }));
      }
    }
    input.addEventListener("input", render);
    render();
    if (F.unmapped.length) {
      document.getElementById("unmapped").textContent = "Backward ops that no forward op explains " +
        "(gradient accumulation and the like): " + F.unmapped.map(([n, c]) => n + " ×" + c).join(", ");
    }
  }

  // checkpointing, per-rank and compiled tables: rows of text, the console's (report/sections.py)
  function optionalSections() {
    const host = document.getElementById("sections");
    for (const s of D.sections || []) {
      const sec = el("section", { class: "optional" }, el("h2", { text: s.title }));
      for (const line of s.lines) sec.append(el("p", { text: line }));
      if (s.columns.length) {
        const t = el("table", { class: "grid" });
        table(t, s.columns.map((c, i) => ({ label: c, get: (r) => r[i] })), s.rows);
        sec.append(el("div", { class: "scroll" }, t));
      }
      for (const line of s.after) sec.append(el("p", { class: "note", text: line }));
      host.append(sec);
    }
  }

  function uncountedSection() {
    const host = document.getElementById("uncounted-body");
    if (!D.uncounted.length) {
      host.append(el("p", { text: "Every op has a FLOP formula." }));
      return;
    }
    host.append(el("p", { class: "hint", text: "Their FLOPs are not in any total (never silently 0)." }));
    const t = el("table", { class: "grid", id: "uncounted-table" });
    table(t, [
      { label: "op", code: true, get: (r) => r[0] },
      { label: "times run", num: true, get: (r) => String(r[1]) },
    ], D.uncounted);
    host.append(t);
  }

  header();
  const u = chart();
  peakSection();
  moduleSection();
  fwdSection();
  optionalSections();
  uncountedSection();
  window.tapescopeReport = { chart: u, readyMs: performance.now() };
  document.body.dataset.ready = "1";
})();
