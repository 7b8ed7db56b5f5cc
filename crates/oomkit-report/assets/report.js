// oomkit's report page: draws the analyses embedded in #oomkit-data.
// Everything it needs is in this file and the vendored uPlot; it makes
// no network request.
(function () {
  "use strict";

  // What the page drew, for people scripting a browser (and oomkit's tests).
  var state = { ready: false, charts: [], markers: [], errors: [] };
  window.oomkitReport = state;

  var COLORS = {
    active: "#2f6fdf", reserved: "#8a94a6", peak: "#e08a00", oom: "#d62828",
    replayed: "#4b5563", whatif: "#2a9d8f",
    trend: "#b5179e", end: "#2a9d8f", start: "#9aa5b1",
  };
  var STAGE_COLORS = ["#2f6fdf", "#2a9d8f", "#e76f51", "#7b2cbf", "#f4a261", "#3a86ff", "#8d99ae"];
  // Runs with more steps than this open zoomed to their first OOM.
  var RUN_ZOOM_MIN_STEPS = 100;
  var PHASE_COLORS = ["#7aa2f7", "#9ece6a", "#e0af68", "#bb9af7", "#7dcfff", "#f7768e", "#73daca"];
  // One color per role, as the chart stacks them and the tables name them.
  var ROLE_COLORS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868",
    "activations": "#c44e52", "temporaries": "#8172b3", "inputs": "#937860",
    "other": "#da8bc3", "unknown": "#b8bec8",
  };
  // The JSON keys of the roles, in the order reports list them, with their words.
  var ROLE_KEYS = [
    ["parameters", "parameters"], ["gradients", "gradients"], ["optimizer_state", "optimizer state"],
    ["activations", "activations"], ["temporaries", "temporaries"], ["inputs", "inputs"],
    ["other", "other"], ["unknown", "unknown"],
  ];

  function el(tag, attrs) {
    var node = document.createElement(tag);
    if (attrs) {
      for (var k in attrs) {
        if (!Object.prototype.hasOwnProperty.call(attrs, k) || attrs[k] == null) continue;
        if (k === "text") node.textContent = attrs[k];
        else if (k === "class") node.className = attrs[k];
        else if (k === "style") node.style.cssText = attrs[k];
        else if (k.slice(0, 2) === "on") node.addEventListener(k.slice(2), attrs[k]);
        else node.setAttribute(k, attrs[k]);
      }
    }
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c == null) continue;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return node;
  }

  // The same units as oomkit's terminal report: binary, three significant digits.
  function bytes(n) {
    if (n == null || isNaN(n)) return "-";
    var neg = n < 0;
    var v = Math.abs(n);
    var units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    var i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    var s = i === 0 ? String(Math.round(v)) : v >= 100 ? fixed(v, 0) : v >= 10 ? fixed(v, 1) : fixed(v, 2);
    return (neg ? "-" : "") + s + " " + units[i];
  }
  state.bytes = bytes;

  // toFixed rounds an exact tie away from zero; the terminal report (Rust's
  // formatting) rounds it to even, so 134.5 MiB reads 134 MiB in both.
  function fixed(v, d) {
    var m = Math.pow(10, d), x = v * m, f = Math.floor(x);
    if (x - f === 0.5 && f % 2 === 0 && (f + 0.5) / m === v) return (f / m).toFixed(d);
    return v.toFixed(d);
  }

  function signedBytes(n) { return (n > 0 ? "+" : "") + bytes(n); }

  function pct(part, whole) { return whole > 0 ? fixed(100 * part / whole, 0) + "%" : "-"; }

  function seconds(us) {
    var s = us / 1e6;
    return (s >= 100 ? s.toFixed(1) : s.toFixed(3)) + " s";
  }

  // Series arrive as a first value and the differences after it.
  function undelta(arr) {
    var out = new Float64Array(arr.length);
    var acc = 0;
    for (var i = 0; i < arr.length; i++) { acc += arr[i]; out[i] = acc; }
    return out;
  }

  // Decodes a series written as its changes: pairs of (points since the
  // last change, change in value) over n points.
  function unchange(pairs, n) {
    var out = new Float64Array(n);
    var at = -1, acc = 0;
    for (var k = 0; k + 1 < pairs.length; k += 2) {
      var next = at + pairs[k];
      for (var i = Math.max(at, 0); i < next && i < n; i++) out[i] = acc;
      at = next;
      acc += pairs[k + 1];
    }
    for (var j = Math.max(at, 0); j < n; j++) out[j] = acc;
    return out;
  }

  function section(parent, title, cls) {
    var p = el("div", { class: "panel" + (cls ? " " + cls : "") }, el("h4", { text: title }));
    parent.appendChild(p);
    return p;
  }

  // A table whose numeric columns sort on a click; `bar` columns draw their
  // value as a bar against the column's largest.
  function table(columns, rows) {
    var t = el("table");
    var head = el("tr");
    var body = el("tbody");
    var sortCol = -1;
    var asc = false;
    var max = columns.map(function (c, i) {
      if (!c.bar) return 0;
      return rows.reduce(function (m, r) { return Math.max(m, Math.abs(r[i]) || 0); }, 0);
    });
    function draw() {
      body.textContent = "";
      rows.forEach(function (r) {
        var tr = el("tr");
        columns.forEach(function (c, i) {
          var v = r[i];
          var text = c.fmt ? c.fmt(v, r) : v == null ? "-" : String(v);
          var td = el("td", { class: (c.num ? "num " : "") + (c.bar ? "bar " : "") + (c.cls || "") });
          if (c.bar && max[i] > 0) {
            td.appendChild(el("span", { class: "fill", style: "width:" + (100 * Math.abs(v || 0) / max[i]).toFixed(1) + "%" }));
            td.appendChild(el("span", { class: "val", text: text }));
          } else {
            td.textContent = text;
          }
          if (c.title) td.title = c.title(v, r) || "";
          tr.appendChild(td);
        });
        body.appendChild(tr);
      });
    }
    columns.forEach(function (c, i) {
      var th = el("th", { class: (c.num ? "num " : "") + (c.sort === false ? "" : "sortable"), text: c.name });
      if (c.sort !== false) {
        th.addEventListener("click", function () {
          asc = sortCol === i ? !asc : !c.num;
          sortCol = i;
          rows.sort(function (a, b) {
            var x = a[i], y = b[i];
            var r = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
            return asc ? r : -r;
          });
          Array.prototype.forEach.call(head.children, function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
          th.classList.add(asc ? "sorted-asc" : "sorted-desc");
          draw();
        });
      }
      head.appendChild(th);
    });
    t.appendChild(el("thead", null, head));
    t.appendChild(body);
    draw();
    return t;
  }

  function findingsList(findings, warnings) {
    var ul = el("ul", { class: "findings" });
    (findings || []).forEach(function (f) {
      ul.appendChild(el("li", null,
        el("span", { class: "kind" + (f.kind === "oom" ? " oom" : ""), text: f.kind }),
        f.message,
        f.advice ? el("div", { class: "advice", text: "\u2192 " + f.advice }) : null));
    });
    (warnings || []).forEach(function (w) {
      ul.appendChild(el("li", null,
        el("span", { class: "kind warn", text: w.kind }),
        w.message,
        w.fix ? el("div", { class: "advice", text: "\u2192 " + w.fix }) : null));
    });
    if (!ul.children.length) ul.appendChild(el("li", { class: "muted", text: "Nothing to report." }));
    return ul;
  }

  // ---- charts -------------------------------------------------------------

  function chartWidth(node) {
    return Math.max(320, Math.min(node.clientWidth || 1200, 1232));
  }

  // Zoom with the wheel around the pointer, pan with shift+wheel or a
  // sideways scroll, and the buttons; dragging selects a range to zoom
  // into, and a double click shows everything again (uPlot's own).
  function interaction(u, xMin, xMax) {
    function setRange(lo, hi) {
      var span = hi - lo;
      var minSpan = Math.min(xMax - xMin, 4);
      if (span < minSpan) { var mid = (lo + hi) / 2; lo = mid - minSpan / 2; hi = mid + minSpan / 2; span = minSpan; }
      if (lo < xMin) { lo = xMin; hi = lo + span; }
      if (hi > xMax) { hi = xMax; lo = Math.max(xMin, hi - span); }
      u.setScale("x", { min: lo, max: hi });
    }
    function zoom(factor, at) {
      var lo = u.scales.x.min, hi = u.scales.x.max;
      if (at == null) at = (lo + hi) / 2;
      setRange(at - (at - lo) * factor, at + (hi - at) * factor);
    }
    function pan(fraction) {
      var lo = u.scales.x.min, hi = u.scales.x.max;
      var d = (hi - lo) * fraction;
      setRange(lo + d, hi + d);
    }
    u.over.addEventListener("wheel", function (e) {
      e.preventDefault();
      var sideways = Math.abs(e.deltaX) > Math.abs(e.deltaY);
      if (e.shiftKey || sideways) {
        pan(((sideways ? e.deltaX : e.deltaY) > 0 ? 1 : -1) * 0.1);
      } else {
        var rect = u.over.getBoundingClientRect();
        var at = u.posToVal(e.clientX - rect.left, "x");
        zoom(e.deltaY < 0 ? 0.75 : 1 / 0.75, at);
      }
    }, { passive: false });
    return {
      zoomIn: function () { zoom(0.5); },
      zoomOut: function () { zoom(2); },
      left: function () { pan(-0.25); },
      right: function () { pan(0.25); },
      reset: function () { u.setScale("x", { min: xMin, max: xMax }); },
      focus: function (x0, x1) {
        var pad = Math.max((x1 - x0) * 0.5, (xMax - xMin) * 0.01, 2);
        setRange(x0 - pad, x1 + pad);
      },
    };
  }

  function tools(ctl) {
    return el("div", { class: "chart-tools" },
      el("button", { type: "button", onclick: ctl.zoomIn, title: "Zoom in", text: "+" }),
      el("button", { type: "button", onclick: ctl.zoomOut, title: "Zoom out", text: "\u2212" }),
      el("button", { type: "button", onclick: ctl.left, title: "Pan left", text: "\u2190" }),
      el("button", { type: "button", onclick: ctl.right, title: "Pan right", text: "\u2192" }),
      el("button", { type: "button", onclick: ctl.reset, title: "Show everything", text: "reset" }),
      el("span", { text: "wheel: zoom \u00b7 shift+wheel: pan \u00b7 drag: zoom to a range \u00b7 double click: reset" }));
  }

  // Vertical marker lines and phase bands, drawn over the series.
  function markerPlugin(marks) {
    return {
      hooks: {
        drawClear: [function (u) {
          var ctx = u.ctx;
          var top = u.bbox.top, h = u.bbox.height;
          ctx.save();
          marks.phases.forEach(function (p) {
            var a = u.valToPos(p.x0, "x", true), b = u.valToPos(p.x1, "x", true);
            if (b < u.bbox.left || a > u.bbox.left + u.bbox.width) return;
            a = Math.max(a, u.bbox.left); b = Math.min(b, u.bbox.left + u.bbox.width);
            ctx.fillStyle = p.color + "22";
            ctx.fillRect(a, top, Math.max(b - a, 1), h);
          });
          ctx.restore();
        }],
        draw: [function (u) {
          var ctx = u.ctx;
          var dpr = window.devicePixelRatio || 1;
          var top = u.bbox.top, h = u.bbox.height, left = u.bbox.left, right = left + u.bbox.width;
          ctx.save();
          ctx.font = (11 * dpr) + "px system-ui, sans-serif";
          ctx.textBaseline = "top";
          marks.phases.forEach(function (p) {
            var a = u.valToPos(p.x0, "x", true), b = u.valToPos(p.x1, "x", true);
            if (b < left || a > right) return;
            a = Math.max(a, left); b = Math.min(b, right);
            ctx.fillStyle = p.color;
            ctx.fillRect(a, top, Math.max(b - a, 1), 4 * dpr);
            if (b - a > ctx.measureText(p.name).width + 6 * dpr) {
              ctx.fillStyle = "#3b4252";
              ctx.fillText(p.name, a + 3 * dpr, top + 6 * dpr);
            }
          });
          function vline(x, color, dash, label, row) {
            var px = u.valToPos(x, "x", true);
            if (px < left - 1 || px > right + 1) return;
            ctx.strokeStyle = color;
            ctx.lineWidth = 1.5 * dpr;
            ctx.setLineDash(dash);
            ctx.beginPath();
            ctx.moveTo(px, top);
            ctx.lineTo(px, top + h);
            ctx.stroke();
            ctx.setLineDash([]);
            var w = ctx.measureText(label).width;
            var tx = px + 4 * dpr + w > right ? px - 4 * dpr - w : px + 4 * dpr;
            ctx.fillStyle = color;
            ctx.fillText(label, tx, top + (20 + 14 * row) * dpr);
          }
          marks.lines.forEach(function (m) { vline(m.x, m.color, m.dash || [], m.label, m.row || 0); });
          ctx.restore();
        }],
      },
    };
  }

  // The hover box: whatever `describe(idx)` returns, beside the pointer.
  function tooltipPlugin(describe) {
    var tip;
    return {
      hooks: {
        init: [function (u) {
          tip = el("div", { class: "tip" });
          u.over.appendChild(tip);
          u.over.addEventListener("mouseleave", function () { tip.style.display = "none"; });
        }],
        setCursor: [function (u) {
          var i = u.cursor.idx;
          if (i == null || u.cursor.left < 0) { tip.style.display = "none"; return; }
          tip.textContent = "";
          describe(i).forEach(function (line) { tip.appendChild(line); });
          tip.style.display = "block";
          var w = tip.offsetWidth, ow = u.over.clientWidth;
          var x = u.cursor.left + 14;
          if (x + w > ow) x = Math.max(0, u.cursor.left - w - 14);
          tip.style.left = x + "px";
          tip.style.top = Math.max(0, Math.min(u.cursor.top + 10, u.over.clientHeight - tip.offsetHeight)) + "px";
        }],
      },
    };
  }

  function bytesAxis() {
    return {
      size: 72,
      values: function (u, splits) { return splits.map(bytes); },
      grid: { stroke: "#eef1f5" },
    };
  }

  function markerButtons(list, ctl) {
    var ul = el("ul", { class: "markers" });
    list.forEach(function (m) {
      ul.appendChild(el("li", null, el("button", {
        type: "button", class: m.kind, "data-marker": m.kind, title: "Zoom to it",
        text: m.text, onclick: function () { ctl.focus(m.x0, m.x1); },
      })));
    });
    return ul;
  }

  // ---- snapshots ----------------------------------------------------------

  function timelineChart(parent, file, dev, zoomToOom) {
    var x = undelta(dev.x), t = undelta(dev.t);
    var active = undelta(dev.active), reserved = undelta(dev.reserved);
    var n = x.length;
    // Reserved as the model of the allocator replays the trace: with the
    // run's settings (it should retrace the line above) and with expandable
    // segments flipped (docs/whatif.md).
    var rep = dev.replayed;
    var simRec = rep ? undelta(rep.as_recorded) : null, simFix = rep ? undelta(rep.whatif) : null;
    // The active bytes stacked by role, as PyTorch's memory profiler draws
    // its categories: band j is drawn from the sum of the roles before it.
    var roleVals = dev.by_role ? dev.by_role.map(function (c) { return unchange(c, n); })
      : (dev.role_start || []).map(function (v0, j) {
        // Every entry kept: each point moves its entry's role by the change in active bytes.
        var out = new Float64Array(n);
        for (var i = 0; i < n; i++) out[i] = i === 0 ? v0 : out[i - 1] + (dev.role[i] === j ? active[i] - active[i - 1] : 0);
        return out;
      });
    var stacked = [];
    roleVals.forEach(function (vals, j) {
      stacked.push(vals.map(function (v, i) { return v + (j ? stacked[j - 1][i] : 0); }));
    });
    var phaseColor = {};
    var phases = dev.phases.map(function (p) {
      if (!(p.name in phaseColor)) phaseColor[p.name] = PHASE_COLORS[Object.keys(phaseColor).length % PHASE_COLORS.length];
      return { name: p.name, x0: p.x0, x1: p.x1, color: phaseColor[p.name] };
    });
    var lines = [];
    var buttons = [];
    dev.ooms.forEach(function (o, i) {
      lines.push({ x: o.x, color: COLORS.oom, label: "OOM " + bytes(o.requested_bytes), row: 1 + (i % 3) });
      buttons.push({ kind: "oom", x0: o.x, x1: o.x, text: "OOM at entry " + (o.x - 1) + ": " + bytes(o.requested_bytes) + " requested (" + o.cause + ")" });
    });
    lines.push({ x: dev.peak.x, color: COLORS.peak, dash: [6, 4], label: "peak " + bytes(dev.peak.bytes), row: 0 });
    buttons.unshift({
      kind: "peak", x0: dev.peak.x, x1: dev.peak.x,
      text: "peak " + bytes(dev.peak.bytes) + (dev.peak.x > 0 ? " at entry " + (dev.peak.x - 1) : " before the trace") + (dev.peak.phase ? " in " + dev.peak.phase : ""),
    });
    var seen = {};
    phases.forEach(function (p) {
      if (seen[p.name]) return;
      seen[p.name] = true;
      var runs = phases.filter(function (q) { return q.name === p.name; });
      buttons.push({ kind: "phase", x0: p.x0, x1: p.x1, text: p.name + (runs.length > 1 ? " (\u00d7" + runs.length + ")" : "") });
    });
    buttons.forEach(function (b) {
      state.markers.push({ file: file.file, device: dev.device, kind: b.kind, x: b.x0, text: b.text });
    });

    var box = el("div", { class: "chart", "data-device": String(dev.device) });
    parent.appendChild(box);
    var xMin = n ? x[0] : 0, xMax = n ? Math.max(x[n - 1], x[0] + 1) : 1;
    function describe(i) {
      var lines = [];
      var ev = x[i] - 1;
      var action = dev.actions[dev.action[i]];
      var head = ev < 0 ? "before the first entry" : "entry " + ev + ": " + action + " " + bytes(dev.size[i]);
      lines.push(el("div", null, el("b", { text: head })));
      if (dev.site[i] >= 0) lines.push(el("div", { class: "site", text: dev.sites[dev.site[i]] }));
      if (dev.role && dev.role[i] >= 0) lines.push(el("div", { text: "role: " + dev.roles[dev.role[i]] }));
      lines.push(el("div", { text: "active " + bytes(active[i]) + " \u00b7 reserved " + bytes(reserved[i]) }));
      if (rep) lines.push(el("div", { class: "muted", text: "replayed: reserved " + bytes(simRec[i]) + " \u00b7 with " + rep.whatif_name + " " + bytes(simFix[i]) }));
      var parts = roleVals.map(function (vals, j) { return [vals[i], dev.roles[j]]; })
        .filter(function (p) { return p[0] > 0; })
        .sort(function (a, b) { return b[0] - a[0]; })
        .map(function (p) { return p[1] + " " + bytes(p[0]); });
      if (parts.length) lines.push(el("div", { class: "muted", text: parts.join(" \u00b7 ") }));
      if (dev.times) lines.push(el("div", { class: "muted", text: "+" + seconds(t[i]) + " from the first entry" }));
      return lines;
    }
    var opts = {
      width: chartWidth(parent),
      height: 340,
      cursor: { drag: { x: true, y: false }, points: { size: 6 } },
      scales: { x: { time: false }, y: { range: function (u, lo, hi) { return [0, Math.max(hi, 1) * 1.08]; } } },
      legend: { show: true, live: false },
      series: [{ label: "trace entry" }].concat(
        // The top band first, so that each lower band is drawn over it.
        stacked.map(function (_, k) {
          var j = stacked.length - 1 - k, name = dev.roles[j];
          return {
            label: name, stroke: ROLE_COLORS[name], fill: ROLE_COLORS[name] + "b0", width: 0.75,
            value: function (u, v, si, i) { return i == null ? "-" : bytes(roleVals[j][i]); },
          };
        }),
        [
          { label: "active", stroke: COLORS.active, fill: stacked.length ? undefined : "rgba(47,111,223,0.14)", width: 1.25, value: function (u, v) { return bytes(v); } },
          { label: "reserved", stroke: COLORS.reserved, width: 1.25, value: function (u, v) { return bytes(v); } },
        ],
        rep ? [
          { label: "reserved, replayed", stroke: COLORS.replayed, width: 1, dash: [2, 3], value: function (u, v) { return bytes(v); } },
          { label: "reserved with " + rep.whatif_name + ", replayed", stroke: COLORS.whatif, width: 1.25, dash: [6, 3], value: function (u, v) { return bytes(v); } },
        ] : []),
      axes: [{ grid: { stroke: "#eef1f5" }, label: dev.decimated ? "trace entry (thinned: min/max per bucket)" : "trace entry", labelSize: 18 }, bytesAxis()],
      plugins: [markerPlugin({ phases: phases, lines: lines }), tooltipPlugin(describe)],
    };
    var u = new uPlot(opts, [x].concat(stacked.slice().reverse(), [active, reserved], rep ? [simRec, simFix] : []), box);
    var ctl = interaction(u, xMin, xMax);
    box.insertBefore(tools(ctl), box.firstChild);
    box.appendChild(markerButtons(buttons, ctl));
    var chart = { file: file.file, device: dev.device, kind: "timeline", points: n, plot: u, zoomed: null };
    state.charts.push(chart);
    if (zoomToOom && dev.ooms.length) {
      // The failing device opens on its first OOM; "reset" shows the whole run.
      var at = dev.ooms[0].x, span = Math.max(50, Math.round((xMax - xMin) / 20));
      ctl.focus(Math.max(xMin, at - span), Math.min(xMax, at + span));
      chart.zoomed = at;
    }
    return u;
  }

  // The bytes of each role at one moment, with how they were told.
  function roleTable(parent, roles, evidence, unknownReason) {
    var total = ROLE_KEYS.reduce(function (s, k) { return s + roles[k[0]]; }, 0);
    var rows = ROLE_KEYS.filter(function (k) { return roles[k[0]] > 0; }).map(function (k) {
      var e = evidence[k[0]];
      var told = k[0] === "unknown" ? (unknownReason || "").replace(/_/g, " ")
        : ["frames", "lifetimes", "sizes"].filter(function (w) { return e[w] > 0; })
          .map(function (w) { return w + (e[w] < roles[k[0]] ? " " + pct(e[w], roles[k[0]]) : ""); }).join(", ");
      return [k[1], roles[k[0]], roles[k[0]], told];
    });
    if (!rows.length) return;
    parent.appendChild(table([
      { name: "role", cls: "role" },
      { name: "bytes", num: true, bar: true, fmt: bytes },
      { name: "share", num: true, fmt: function (v) { return pct(v, total); } },
      { name: "told by" },
    ], rows));
  }

  function segmentsPanel(parent, dev, rep) {
    var p = section(parent, "Segments and fragmentation");
    var fr = rep.fragmentation;
    p.appendChild(el("div", null,
      "Reserved " + bytes(rep.reserved_bytes) + ", allocated " + bytes(rep.allocated_bytes) + " in " + rep.segments + " segments. Free inside segments: ",
      el("b", { text: bytes(fr.external_bytes) }), " in " + fr.free_blocks + " inactive blocks (external, largest " + bytes(fr.largest_free_block_bytes) + ") and ",
      el("b", { text: bytes(fr.internal_bytes) }), " of rounding (internal)."));
    p.appendChild(el("div", { class: "legend-inline muted" },
      el("span", { style: "background:var(--active)" }), "requested",
      el("span", { style: "background:#9db8ec" }), "rounding",
      el("span", { style: "background:var(--free)" }), "free"));
    if (!dev.segments.length) { p.appendChild(el("div", { class: "muted", text: "No segments at snapshot time." })); return; }
    var largest = dev.segments[0].total_bytes || 1;
    var list = el("div", { class: "segs" });
    p.appendChild(list);
    dev.segments.forEach(function (s) {
      var req = Math.min(s.requested_bytes, s.allocated_bytes);
      var w = 100 * s.total_bytes / largest;
      var track = el("div", { class: "track", style: "width:" + Math.max(w, 0.5).toFixed(2) + "%" },
        el("span", { class: "req", style: "width:" + pct(req, s.total_bytes) }),
        el("span", { class: "round", style: "width:" + pct(s.allocated_bytes - req, s.total_bytes) }));
      track.title = s.address + ": " + bytes(s.total_bytes) + " (" + s.type + " pool, stream " + s.stream + "), " + s.blocks + " blocks, "
        + bytes(s.allocated_bytes) + " allocated, largest free block " + bytes(s.largest_free_bytes);
      list.appendChild(el("div", { class: "seg" },
        el("span", { class: "addr", text: s.address }), track, el("span", { class: "num", text: bytes(s.total_bytes) })));
    });
    if (dev.segments_total > dev.segments.length) {
      p.appendChild(el("div", { class: "muted", text: "The largest " + dev.segments.length + " of " + dev.segments_total + " segments." }));
    }
  }

  function renderSnapshot(root, f) {
    var a = f.analysis;
    var v = a.verdict || {};
    var failing = v.failed && v.place ? v.place.device : null;
    if (!f.devices.length) root.appendChild(el("p", { class: "muted", text: "No device holds any memory in this snapshot." }));
    // The failing device first, as in the terminal report.
    var order = f.devices.map(function (dev, di) { return di; });
    order.sort(function (i, j) { return (("cuda:" + f.devices[j].device) === failing) - (("cuda:" + f.devices[i].device) === failing); });
    order.forEach(function (di) {
      var dev = f.devices[di];
      var rep = a.devices[di];
      var isFailing = ("cuda:" + dev.device) === failing;
      root.appendChild(el("h3", { id: anchor(f.file, "cuda" + dev.device), text: "cuda:" + dev.device }));
      var head = el("div", { class: "headline" }, "Peak ", el("b", { text: bytes(rep.peak_active_bytes) }), " active");
      if (rep.top_sites_at === "snapshot") head.appendChild(document.createTextNode(" at snapshot time (no trace recorded)"));
      else if (rep.peak_event_index != null) head.appendChild(document.createTextNode(" at entry " + rep.peak_event_index + (rep.peak_offset_s != null ? " (+" + rep.peak_offset_s.toFixed(3) + " s)" : "")));
      if (rep.peak_phase) head.appendChild(document.createTextNode(", in phase " + rep.peak_phase));
      head.appendChild(document.createTextNode(" \u00b7 " + rep.events + " trace entries \u00b7 peak reserved " + bytes(rep.peak_reserved_bytes) + " \u00b7 " + rep.ooms.length + " OOM" + (rep.ooms.length === 1 ? "" : "s")));
      root.appendChild(head);
      if (dev.events > 0) {
        timelineChart(root, f, dev, isFailing);
      } else {
        // Without a trace there is no timeline, only the state at snapshot time.
        var text = "peak " + bytes(dev.peak.bytes) + " active at snapshot time";
        state.markers.push({ file: f.file, device: dev.device, kind: "peak", x: 0, text: text });
        root.appendChild(el("div", { class: "panel" },
          el("ul", { class: "markers" }, el("li", null, el("button", { type: "button", class: "peak", "data-marker": "peak", text: text }))),
          el("div", { class: "muted", text: "No timeline: this snapshot has no trace. Call torch.cuda.memory._record_memory_history(max_entries=1_000_000) before the memory you care about is allocated." })));
      }
      var grid = el("div", { class: "grid" });
      root.appendChild(grid);

      var sites = section(grid, rep.top_sites_at === "snapshot" ? "Live at snapshot time, by site" : "Live at the peak, by site");
      sites.appendChild(table([
        { name: "bytes", num: true, bar: true, fmt: bytes },
        { name: "share", num: true, fmt: function (v) { return pct(v, rep.peak_active_bytes); } },
        { name: "allocations", num: true },
        { name: "site", cls: "site", title: function (v, r) { return r[4]; } },
      ], rep.top_sites.map(function (s) {
        var stack = (s.stack || []).slice(0, 12).map(function (fr) { return fr.filename + ":" + fr.line + " " + fr.name; }).join("\n");
        return [s.bytes, s.bytes, s.count, s.label, stack];
      })));

      roleTable(section(grid, rep.top_sites_at === "snapshot" ? "Live at snapshot time, by role" : "Live at the peak, by role"),
        rep.roles.peak, rep.roles_evidence.peak, rep.roles_unknown_reason.peak);

      var oom = section(grid, "Out-of-memory events");
      oom.id = anchor(f.file, "oom" + dev.device);
      if (!rep.ooms.length) oom.appendChild(el("div", { class: "muted", text: "No OOM in this trace." }));
      rep.ooms.forEach(function (o, oi) {
        oom.appendChild(el("div", oi === 0 ? { id: anchor(f.file, "site" + dev.device) } : null,
          el("b", { text: "Entry " + o.event_index + ": " + bytes(o.requested_bytes) + " requested" }),
          " from " + o.label + ". Cause: ", el("b", { text: o.cause }),
          " (" + bytes(o.live_bytes) + " live, " + bytes(o.reserved_unallocated_bytes) + " reserved but unallocated, " + bytes(o.free_bytes) + " free on the device)."));
        if (o.roles) roleTable(oom, o.roles, o.roles_evidence, o.roles_unknown_reason);
        if (o.top_holders.length) {
          oom.appendChild(table([
            { name: "held then", num: true, bar: true, fmt: bytes },
            { name: "site", cls: "site" },
          ], o.top_holders.map(function (h) { return [h.bytes, h.label]; })));
        }
      });

      segmentsPanel(grid, dev, rep);

      if (rep.phases.length) {
        var ph = section(grid, "Phases (record_function ranges)");
        ph.appendChild(table([
          { name: "phase" },
          { name: "runs", num: true },
          { name: "peak", num: true, bar: true, fmt: bytes },
          { name: "largest growth", num: true, fmt: bytes },
          { name: "retained", num: true, fmt: signedBytes },
        ], rep.phases.map(function (q) { return [q.name, q.occurrences, q.peak_active_bytes, q.max_growth_bytes, q.retained_bytes]; })));
      }
    });
    var fp = section(root.appendChild(el("div", { class: "grid" })), "Findings and what to change", "wide");
    fp.appendChild(findingsList(a.findings, a.warnings));
  }

  // ---- run logs -----------------------------------------------------------

  function renderRun(root, f) {
    var a = f.analysis;
    var steps = f.steps;
    root.appendChild(el("div", { class: "headline" },
      a.steps + " steps on " + a.device + " (rank " + a.rank + "), peak ", el("b", { text: bytes(a.peak_bytes) }),
      a.capacity_bytes ? " of " + bytes(a.capacity_bytes) : "",
      " \u00b7 " + a.ooms.length + " OOM" + (a.ooms.length === 1 ? "" : "s")));
    var grid = el("div", { class: "grid" });
    if (steps.length) {
      var xs = Float64Array.from(steps);
      var data = [xs];
      var series = [{ label: "step" }];
      function add(label, values, color, extra) {
        data.push(values.map(function (v) { return v == null ? null : v; }));
        var s = { label: label, stroke: color, width: 1.5, value: function (u, v) { return v == null ? "-" : bytes(v); } };
        for (var k in extra) s[k] = extra[k];
        series.push(s);
      }
      add("step peak", f.series.peak, COLORS.active, { fill: "rgba(47,111,223,0.10)" });
      add("end of step", f.series.end, COLORS.end);
      if (f.series.reserved.some(function (v) { return v > 0; })) add("reserved", f.series.reserved, COLORS.reserved, { dash: [4, 3] });
      f.stages.forEach(function (s, i) { add(s.name + " peak", s.peak, STAGE_COLORS[(i + 2) % STAGE_COLORS.length], { width: 1, show: s.name !== "forward" || f.stages.length < 4 }); });
      if (a.leak) {
        var L = a.leak;
        add("leak trend", steps.map(function (s) {
          return s >= L.first_step && s <= L.last_step ? L.start_bytes + L.bytes_per_step * (s - L.first_step) : null;
        }), COLORS.trend, { dash: [8, 4], width: 2 });
      }
      var byStep = {};
      f.phases.forEach(function (p) {
        if (p.step == null) return;
        byStep[p.step] = Math.max(byStep[p.step] || 0, p.peak_bytes);
      });
      if (f.phases.length) {
        add("phase peak", steps.map(function (s) { return s in byStep ? byStep[s] : null; }), COLORS.peak, {
          paths: function () { return null; }, points: { show: true, size: 7, fill: COLORS.peak },
        });
      }
      var lines = [];
      var buttons = [];
      var peakStep = null, peakVal = -1;
      f.series.peak.forEach(function (v, i) { if (v != null && v > peakVal) { peakVal = v; peakStep = steps[i]; } });
      if (peakStep != null) {
        lines.push({ x: peakStep, color: COLORS.peak, dash: [6, 4], label: "peak " + bytes(peakVal), row: 0 });
        buttons.push({ kind: "peak", x0: peakStep, x1: peakStep, text: "peak " + bytes(peakVal) + " at step " + peakStep });
      }
      f.ooms.forEach(function (o, i) {
        var s = o.step != null ? o.step : steps[steps.length - 1];
        lines.push({ x: s, color: COLORS.oom, label: "OOM" + (o.stage ? " in " + o.stage : ""), row: 1 + (i % 3) });
        buttons.push({ kind: "oom", x0: s, x1: s, text: "OOM at step " + s + (o.stage ? " (" + o.stage + ")" : "") + (o.requested_bytes != null ? ": " + bytes(o.requested_bytes) + " requested" : "") });
      });
      buttons.forEach(function (b) { state.markers.push({ file: f.file, device: a.device, kind: b.kind, x: b.x0, text: b.text }); });
      var box = el("div", { class: "chart" });
      root.appendChild(box);
      var xMin = xs[0], xMax = Math.max(xs[xs.length - 1], xs[0] + 1);
      var u = new uPlot({
        width: chartWidth(root),
        height: 320,
        cursor: { drag: { x: true, y: false } },
        // Steps vary little against the whole, so the axis starts near the
        // lowest reading unless that would hide how far it is from zero.
        scales: { x: { time: false }, y: { range: function (u, lo, hi) {
          hi = Math.max(hi, 1);
          return lo > 0.6 * hi ? [lo - (hi - lo) * 0.3 - hi * 0.01, hi + (hi - lo) * 0.15 + hi * 0.01] : [0, hi * 1.08];
        } } },
        series: series,
        axes: [{ grid: { stroke: "#eef1f5" }, label: "step", labelSize: 18, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000] }, bytesAxis()],
        plugins: [markerPlugin({ phases: [], lines: lines })],
      }, data, box);
      var ctl = interaction(u, xMin, xMax);
      box.insertBefore(tools(ctl), box.firstChild);
      box.appendChild(markerButtons(buttons, ctl));
      var chart = { file: f.file, device: a.device, kind: "steps", points: xs.length, plot: u, zoomed: null };
      state.charts.push(chart);
      // A long run opens on its first OOM; a short one shows it whole.
      var firstOom = f.ooms.length ? (f.ooms[0].step != null ? f.ooms[0].step : xMax) : null;
      if (firstOom != null && xMax - xMin > RUN_ZOOM_MIN_STEPS) {
        var w = Math.max(10, Math.round((xMax - xMin) / 20));
        ctl.focus(Math.max(xMin, firstOom - w), Math.min(xMax, firstOom + w));
        chart.zoomed = firstOom;
      }
    } else {
      root.appendChild(el("p", { class: "muted", text: "No step was recorded." }));
    }
    root.appendChild(grid);

    var st = section(grid, "Memory per stage");
    st.appendChild(table([
      { name: "kind" }, { name: "stage" }, { name: "count", num: true },
      { name: "mean peak", num: true, fmt: bytes }, { name: "max peak", num: true, bar: true, fmt: bytes },
      { name: "mean rise", num: true, fmt: bytes }, { name: "mean delta", num: true, fmt: signedBytes },
      { name: "mean time", num: true, fmt: function (v) { return (v * 1000).toFixed(1) + " ms"; } },
    ], a.stages.map(function (s) { return [s.kind, s.name, s.count, s.mean_peak_bytes, s.max_peak_bytes, s.mean_rise_bytes, s.mean_delta_bytes, s.mean_seconds]; })));

    var c = a.components;
    var cp = section(grid, "What the memory holds at the peak");
    if (c) {
      var parts = [
        ["parameters", c.params_bytes, "#2f6fdf"], ["gradients", c.grads_bytes, "#2a9d8f"],
        ["optimizer state", c.optimizer_state_bytes, "#e76f51"], ["EMA", c.ema_bytes, "#7b2cbf"],
        ["buffers", c.buffers_bytes, "#8d99ae"],
      ];
      var known = parts.reduce(function (s, p) { return s + p[1]; }, 0);
      if (a.peak_bytes > known) parts.push(["activations and other", a.peak_bytes - known, "#f4a261"]);
      var total = parts.reduce(function (s, p) { return s + p[1]; }, 0) || 1;
      var bar = el("div", { class: "stack" });
      var legend = el("div", { class: "legend-inline" });
      parts.forEach(function (p) {
        if (p[1] <= 0) return;
        var s = el("span", { style: "width:" + (100 * p[1] / total).toFixed(2) + "%;background:" + p[2] });
        s.title = p[0] + ": " + bytes(p[1]);
        bar.appendChild(s);
        legend.appendChild(el("span", { style: "background:" + p[2] }));
        legend.appendChild(document.createTextNode(p[0] + " " + bytes(p[1])));
      });
      cp.appendChild(bar);
      cp.appendChild(legend);
      if ((c.by_module || []).length) {
        cp.appendChild(table([
          { name: "module" }, { name: "parameters", num: true, bar: true, fmt: bytes },
          { name: "trainable", num: true, fmt: bytes }, { name: "frozen" },
        ], c.by_module.map(function (m) { return [m.name, m.params_bytes, m.trainable_bytes, m.frozen ? "yes" : "no"]; })));
      }
    } else {
      cp.appendChild(el("div", { class: "muted", text: "The log has no component count." }));
    }

    if (a.ooms.length) {
      var op = section(grid, "Out-of-memory events");
      op.appendChild(table([
        { name: "step", num: true }, { name: "stage" }, { name: "requested", num: true, fmt: bytes },
        { name: "allocated", num: true, fmt: bytes }, { name: "reserved", num: true, fmt: bytes }, { name: "cause" }, { name: "snapshot" },
      ], a.ooms.map(function (o) { return [o.step, o.stage, o.requested_bytes, o.allocated_bytes, o.reserved_bytes, o.cause, o.snapshot]; })));
    }
    var fp = section(grid, "Findings and what to change", "wide");
    fp.appendChild(findingsList(a.findings, a.warnings));
  }

  // ---- ranks --------------------------------------------------------------

  // The attempts of a job that stepped down: the plan each ran and how it ended.
  function attemptOutcome(a) {
    var text;
    if (a.outcome === "finished") text = "finished";
    else if (a.outcome === "ended") text = "ended without an OOM of its own";
    else if (a.first_oom) {
      var f = a.first_oom;
      var at = f.step != null ? "step " + f.step : f.killed_by_kernel ? "before any record" : "outside a step";
      if (f.stage) at += ", " + f.stage;
      text = "rank " + f.rank + (f.killed_by_kernel ? " was killed for host memory" : " ran out of memory") + (a.ranks.length > 1 ? " first" : "") + " (" + at + ")";
    } else text = a.ooms + (a.ooms === 1 ? " OOM" : " OOMs") + " recorded; the logs do not tell which rank was first";
    if (a.applied === false) text += " (the plan was not applied)";
    return text;
  }

  function renderAttempts(root, attempts) {
    root.appendChild(el("h2", { text: "Attempts" }));
    var grid = el("div", { class: "grid" });
    root.appendChild(grid);
    var p = section(grid, attempts.length + " attempts of one job", "wide");
    p.appendChild(table([
      { name: "attempt", num: true },
      { name: "micro-batch", num: true },
      { name: "accumulation", num: true },
      { name: "effective", num: true },
      { name: "ranks" },
      { name: "outcome" },
    ], attempts.map(function (a) {
      return [a.attempt, a.micro_batch, a.grad_accum, a.effective_batch, a.ranks.join(","), attemptOutcome(a)];
    })));
  }

  function renderRanks(root, rows) {
    root.appendChild(el("h2", { text: "Ranks" }));
    var grid = el("div", { class: "grid" });
    root.appendChild(grid);
    var p = section(grid, rows.length + " files side by side", "wide");
    var attempts = rows.some(function (r) { return r.attempt != null; });
    var cols = [
      { name: "rank", num: true, fmt: function (v) { return v == null ? "?" : String(v); } },
    ];
    if (attempts) cols.push({ name: "attempt", num: true });
    p.appendChild(table(cols.concat([
      { name: "device" },
      { name: "peak", num: true, bar: true, fmt: bytes },
      { name: "above smallest", num: true, fmt: function (v) { return (100 * v).toFixed(0) + "%"; } },
      { name: "reserved", num: true, fmt: bytes },
      { name: "OOMs", num: true },
      { name: "first OOM" },
      { name: "flags" },
      { name: "file", cls: "site" },
    ]), rows.map(function (r) {
      var flags = [];
      if (r.imbalanced) flags.push("largest peak (imbalance)");
      if (r.failed_first) flags.push("failed first");
      var head = attempts ? [r.rank, r.attempt] : [r.rank];
      return head.concat([r.device, r.peak_bytes, r.above_smallest, r.reserved_bytes, r.ooms, r.first_oom || "-", flags.join(", ") || "-", r.file]);
    })));
    var first = rows.filter(function (r) { return r.failed_first; })[0];
    if (first) p.appendChild(el("p", null, el("span", { class: "flag first", text: "failed first" }), " " + (first.rank != null ? "rank " + first.rank : first.file) + " ran out of memory first (" + first.first_oom + "); the other ranks' errors likely follow from it."));
    var imb = rows.filter(function (r) { return r.imbalanced; })[0];
    if (imb) p.appendChild(el("p", null, el("span", { class: "flag imb", text: "imbalance" }), " " + (imb.rank != null ? "rank " + imb.rank : imb.file) + " peaks " + (100 * imb.above_smallest).toFixed(0) + "% above the smallest rank; the largest rank sets the memory every rank needs."));
  }

  // ---- page ---------------------------------------------------------------

  // A fragment id for a part of one file's report.
  function anchor(file, part) {
    return "f" + String(file).replace(/[^A-Za-z0-9]/g, "_") + "-" + part;
  }

  // The banner above everything: the verdict of the file that failed first
  // (or the first file's), with links to its OOM panel and the site's stack.
  function banner(app, data, first) {
    var v = first.analysis.verdict;
    if (!v) return;
    var box = el("div", { id: "verdict", class: "verdict " + (v.failed ? "failed" : "healthy") });
    var attempts = data.attempts || [];
    var last = attempts[attempts.length - 1];
    if (last) box.appendChild(el("div", { class: "muted", text: "The last of " + attempts.length + " attempts, " + last.attempt + ": " + attemptOutcome(last) + " \u00b7 " + first.file }));
    else if (data.files.length > 1) box.appendChild(el("div", { class: "muted", text: v.failed ? first.file + " failed first" : "No OOM in any of the " + data.files.length + " files" }));
    box.appendChild(el("div", { class: "verdict-headline", text: v.headline }));
    box.appendChild(el("div", { class: "verdict-detail", text: v.detail }));
    if (v.failed && first.kind === "snapshot" && v.place && v.place.device) {
      var d = v.place.device.replace("cuda:", "");
      box.appendChild(el("div", { class: "verdict-links" },
        el("a", { href: "#" + anchor(first.file, "cuda" + d), text: "timeline at the OOM" }), " \u00b7 ",
        el("a", { href: "#" + anchor(first.file, "oom" + d), text: "the OOM and what held the memory" }), v.site ? " \u00b7 " : "",
        v.site ? el("a", { href: "#" + anchor(first.file, "site" + d), text: "the site: " + v.site }) : ""));
    }
    app.appendChild(box);
  }

  function render() {
    var data = JSON.parse(document.getElementById("oomkit-data").textContent);
    var app = document.getElementById("app");
    app.textContent = "";
    var names = data.files.map(function (f) { return f.file; });
    document.title = "oomkit: " + names.join(", ");
    app.appendChild(el("h1", { text: "oomkit memory report" }));
    app.appendChild(el("div", { class: "muted", text: data.generator + " \u00b7 " + names.length + " file" + (names.length === 1 ? "" : "s") + " \u00b7 opens offline, nothing is fetched" }));
    // The file that failed first leads: by the rank table, else the first with an OOM.
    var firstRow = (data.ranks || []).filter(function (r) { return r.failed_first; })[0];
    // Of a job that stepped down, the last attempt leads: its failing file, else any of its files.
    var lastAttempt = data.attempts && data.attempts.length ? data.attempts[data.attempts.length - 1].attempt : null;
    var ofLast = data.files.filter(function (f) { return lastAttempt != null && f.analysis.attempt === lastAttempt; });
    var lead = ofLast.filter(function (f) { return f.analysis.verdict && f.analysis.verdict.failed; })[0]
      || ofLast[0]
      || data.files.filter(function (f) { return firstRow && f.file === firstRow.file; })[0]
      || data.files.filter(function (f) { return f.analysis.verdict && f.analysis.verdict.failed; })[0]
      || data.files[0];
    if (lead) banner(app, data, lead);
    if (data.attempts && data.attempts.length) renderAttempts(app, data.attempts);
    if (data.ranks && data.ranks.length) renderRanks(app, data.ranks);
    var files = data.files.slice().sort(function (a, b) { return (b === lead) - (a === lead); });
    files.forEach(function (f) {
      var root = el("section", { class: "file", "data-kind": f.kind });
      app.appendChild(root);
      root.appendChild(el("h2", { text: f.file + (f.kind === "run" ? " (run log)" : " (snapshot)") }));
      try {
        if (f.kind === "snapshot") renderSnapshot(root, f);
        else renderRun(root, f);
      } catch (e) {
        state.errors.push(String(e && e.stack || e));
        root.appendChild(el("div", { class: "error", text: "This part of the report could not be drawn: " + e }));
        console.error(e);
      }
    });
    window.addEventListener("resize", function () {
      state.charts.forEach(function (c) {
        var w = chartWidth(c.plot.root.parentNode.parentNode || app);
        c.plot.setSize({ width: w, height: c.plot.height });
      });
    });
    state.ready = true;
    document.body.setAttribute("data-ready", "1");
  }

  render();
})();
