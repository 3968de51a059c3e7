// idem serve's console: draws the live charts from /api/live and shows an
// outage of the store, without reloading the page. Every value from the
// server is written with textContent or as an SVG attribute holding a
// number: nothing received is parsed as HTML.
"use strict";
(function () {
  var SVG = "http://www.w3.org/2000/svg";
  var W = 320, H = 110, PAD_L = 40, PAD_R = 6, PAD_T = 8, PAD_B = 18;

  function el(name, attrs, text) {
    var e = document.createElementNS(SVG, name);
    for (var k in attrs) e.setAttribute(k, String(attrs[k]));
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function html(name, cls, text) {
    var e = document.createElement(name);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function fmt(n) {
    if (n >= 1e6) return (n / 1e6).toFixed(1) + "M";
    if (n >= 1e4) return Math.round(n / 1e3) + "k";
    return String(Math.round(n));
  }

  function span(s) {
    if (s < 120) return Math.round(s) + " s";
    return Math.round(s / 60) + " min";
  }

  // chart returns a figure with one line per series; a null value is a
  // gap, and samples where the store did not answer are shaded.
  function chart(title, series, data, legendKeys) {
    var fig = html("figure", "chart");
    fig.appendChild(html("h3", "", title));
    var t = data.t, n = t.length;
    // The axis spans the samples kept, up to the window: a console started
    // ten minutes ago draws ten minutes across the whole width.
    var end = n ? t[n - 1] : Date.now(), start = n ? Math.max(t[0], end - data.window_s * 1000) : end - data.window_s * 1000;
    var maxV = 1;
    series.forEach(function (s) { s.values.forEach(function (v) { if (v !== null && v > maxV) maxV = v; }); });
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": title });
    var x = function (ms) { return PAD_L + (W - PAD_L - PAD_R) * (ms - start) / (end - start || 1); };
    var y = function (v) { return PAD_T + (H - PAD_T - PAD_B) * (1 - v / maxV); };
    // Outages: shade each sample the store did not answer.
    var half = (data.interval_s * 1000) / 2;
    for (var i = 0; i < n; i++) {
      if (!data.up[i]) {
        var x0 = Math.max(PAD_L, x(t[i] - half)), x1 = Math.min(W - PAD_R, x(t[i] + half));
        svg.appendChild(el("rect", { x: x0, y: PAD_T, width: Math.max(x1 - x0, 1), height: H - PAD_T - PAD_B, fill: "#fbd3cf", "class": "gap" }));
      }
    }
    svg.appendChild(el("line", { x1: PAD_L, y1: H - PAD_B, x2: W - PAD_R, y2: H - PAD_B, stroke: "#b9c0cb" }));
    svg.appendChild(el("line", { x1: PAD_L, y1: PAD_T, x2: PAD_L, y2: H - PAD_B, stroke: "#b9c0cb" }));
    svg.appendChild(el("text", { x: PAD_L - 4, y: PAD_T + 8, "text-anchor": "end", "font-size": 9, fill: "#69707d" }, fmt(maxV)));
    svg.appendChild(el("text", { x: PAD_L - 4, y: H - PAD_B, "text-anchor": "end", "font-size": 9, fill: "#69707d" }, "0"));
    svg.appendChild(el("text", { x: PAD_L, y: H - 4, "font-size": 9, fill: "#69707d" }, "-" + span((end - start) / 1000)));
    svg.appendChild(el("text", { x: W - PAD_R, y: H - 4, "text-anchor": "end", "font-size": 9, fill: "#69707d" }, "now"));
    series.forEach(function (s) {
      var d = "", pen = false, pts = 0;
      for (var i = 0; i < n; i++) {
        var v = s.values[i];
        if (v === null || v === undefined) { pen = false; continue; }
        d += (pen ? "L" : "M") + x(t[i]).toFixed(1) + " " + y(v).toFixed(1);
        pen = true; pts++;
      }
      if (d) {
        svg.appendChild(el("path", { d: d, fill: "none", stroke: s.color, "stroke-width": 1.6, "class": "series " + s.key }));
        if (pts === 1) { // a single point is no line: mark it
          var m = /M([\d.]+) ([\d.]+)/.exec(d);
          if (m) svg.appendChild(el("circle", { cx: m[1], cy: m[2], r: 2, fill: s.color }));
        }
      }
    });
    fig.appendChild(svg);
    var legend = html("div", "legend");
    (legendKeys || series).forEach(function (s) {
      var item = html("span");
      item.appendChild(html("span", "key " + s.key));
      var last = null;
      if (s.values) for (var i = n - 1; i >= 0; i--) if (s.values[i] !== null) { last = s.values[i]; break; }
      item.appendChild(document.createTextNode(s.label + (last !== null ? " " + fmt(last) : "")));
      legend.appendChild(item);
    });
    if (data.up.indexOf(false) >= 0) {
      var g = html("span"); g.appendChild(html("span", "key gap")); g.appendChild(document.createTextNode("store down"));
      legend.appendChild(g);
    }
    fig.appendChild(legend);
    return fig;
  }

  function draw(root, status, data) {
    var figs = [];
    data.handlers.forEach(function (h) {
      figs.push(chart(h.name, [
        { key: "applied", label: "applied", color: "#1f6fd1", values: h.applied },
        { key: "duplicates", label: "duplicates", color: "#8a94a3", values: h.duplicates },
        { key: "errors", label: "dead letters", color: "#c62828", values: h.dead_letters }
      ], data));
    });
    figs.push(chart("Dead letters parked", [{ key: "depth", label: "parked", color: "#b26a00", values: data.parked }], data));
    figs.push(chart("Outbox", [
      { key: "lag", label: "oldest pending, s", color: "#6a3fb5", values: data.outbox_lag_s },
      { key: "pending", label: "pending", color: "#2e7d32", values: data.outbox_pending }
    ], data));
    root.replaceChildren.apply(root, figs);
    var n = data.t.length;
    status.textContent = n === 0 ? "No sample yet." :
      "Per " + data.interval_s + " s interval: messages applied, duplicates and new dead letters per handler; " + n +
      " samples, the last at " + new Date(data.t[n - 1]).toISOString().replace(/\.\d+Z$/, "Z") + ". Updates by itself.";
  }

  function outage(data) {
    var b = document.getElementById("live-outage");
    if (!b) return;
    if (data && data.down) {
      b.textContent = "Outage: the store has not answered since " + new Date(data.down.since).toISOString().replace(/\.\d+Z$/, "Z") +
        ". Consumers pause while it is down and resume by themselves. Last error: " + data.down.error;
      b.hidden = false;
    } else {
      b.hidden = true;
    }
  }

  function start() {
    var root = document.getElementById("live"), status = document.getElementById("live-status");
    var every = 5000;
    function poll() {
      fetch("/api/live", { credentials: "same-origin", cache: "no-store" }).then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      }).then(function (data) {
        every = Math.min(Math.max(data.interval_s * 1000, 1000), 15000);
        outage(data);
        if (root) draw(root, status, data);
        document.body.setAttribute("data-live-samples", String(data.t.length));
      }).catch(function (e) {
        if (status) status.textContent = "The console does not answer: " + e.message;
      }).then(function () { setTimeout(poll, every); });
    }
    poll();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
