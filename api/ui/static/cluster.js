// The cluster view: Ray's nodes and resources as the dispatcher last saw them, the caller's running jobs, and the
// queues. Plain GETs read again every POLL_MS (the snapshot changes at the dispatcher's pace, not per event).
"use strict";

(() => {
  const S = shunter;
  const POLL_MS = 5000;
  const GIB = 1024 ** 3;

  function pair(node, key, scale = 1) {
    const total = (node.total || {})[key];
    if (total === undefined) return "";
    const free = (node.available || {})[key] || 0;
    return `${S.num(free / scale, 3)} / ${S.num(total / scale, 3)}`;
  }

  function bar(free, total) {
    const used = total > 0 ? Math.min(1, Math.max(0, (total - free) / total)) : 0;
    const fillBar = S.el("i");
    fillBar.style.width = `${Math.round(used * 100)}%`; // CSSOM, not a style attribute: allowed by the CSP
    return S.el("span", { class: "bar", title: `${Math.round(used * 100)}% in use` }, fillBar);
  }

  function render(view, queues) {
    S.fill(S.$("seen"), view.taken_at ? `seen ${S.time(view.taken_at)} (${S.num(view.age_seconds, 3)} s ago)` : "never seen");
    const link = S.$("dashboard");
    const url = view.dashboard_url ? S.safeUrl(view.dashboard_url) : null;
    link.hidden = !url;
    if (url) link.href = url;
    const keys = Object.keys(view.total || {}).filter((k) => !k.startsWith("node:") && !k.startsWith("accelerator_type")).sort();
    S.fill(
      S.$("resource-rows"),
      keys.map((k) => {
        const scale = k.includes("memory") ? GIB : 1;
        const unit = scale === GIB ? " GiB" : "";
        const free = (view.available || {})[k] || 0;
        const total = view.total[k];
        return S.el("tr", { "data-resource": k }, S.el("td", {}, k), S.el("td", { class: "num" }, S.num(free / scale, 3) + unit),
          S.el("td", { class: "num" }, S.num(total / scale, 3) + unit), S.el("td", {}, bar(free, total)));
      }),
    );
    S.$("no-nodes").hidden = view.nodes.length > 0;
    S.fill(
      S.$("node-rows"),
      view.nodes.map((n) =>
        S.el("tr", { "data-node": n.node_id }, S.el("td", { class: "mono" }, n.node_id.slice(0, 12)), S.el("td", {}, n.address || ""),
          S.el("td", { class: n.alive ? "yes" : "no" }, n.alive ? "alive" : "dead"), S.el("td", {}, pair(n, "CPU")),
          S.el("td", {}, pair(n, "GPU")), S.el("td", {}, pair(n, "memory", GIB))),
      ),
    );
    S.fill(
      S.$("running-rows"),
      view.jobs.map((j) => {
        const dash = j.ray_dashboard_url ? S.el("a", { href: j.ray_dashboard_url, class: "ext", target: "_blank", rel: "noopener noreferrer" }, "Ray") : "";
        return S.el("tr", { "data-job-id": j.id },
          S.el("td", {}, S.el("a", { class: "name", href: S.jobLink(j.id) }, j.name), S.el("span", { class: "id mono" }, j.id)),
          S.el("td", {}, j.owner), S.el("td", {}, j.queue), S.el("td", {}, S.stateBadge(j.state)),
          S.el("td", { class: "num" }, String(j.attempt)), S.el("td", {}, S.resources(j.resources)), S.el("td", {}, S.time(j.started_at)),
          S.el("td", {}, dash));
      }),
    );
    S.fill(
      S.$("queue-rows"),
      queues.map((q) => {
        const limits = Object.entries(q.limits || {}).filter(([, v]) => v !== null && v !== false && typeof v !== "object").map(([k, v]) => `${k} ${v}`).join(", ");
        return S.el("tr", { "data-queue": q.name }, S.el("td", {}, q.name), S.el("td", { class: "num" }, String(q.running)),
          S.el("td", { class: "num" }, String(q.queued)), S.el("td", { class: "num" }, S.num(q.cpus_in_use, 3)),
          S.el("td", { class: "num" }, S.num(q.gpus_in_use, 3)), S.el("td", {}, limits));
      }),
    );
    // The room a dispatcher asked the cluster's autoscaler for (SHUNTER_CLUSTER_MAY_GROW): the running groups' and
    // the waiting jobs' bundles, counted by shape.
    const ask = view.scale_request;
    S.$("scale-section").hidden = !ask;
    if (ask) {
      S.$("scale-summary").textContent = `${ask.bundles.length} bundles for ${ask.jobs} waiting job(s) and the running ones, asked at ${ask.asked_at || "?"}`;
      const shapes = new Map();
      for (const b of ask.bundles) {
        const key = S.resources(b);
        shapes.set(key, (shapes.get(key) || 0) + 1);
      }
      S.fill(S.$("scale-rows"), [...shapes].map(([shape, n]) => S.el("tr", {}, S.el("td", {}, shape), S.el("td", { class: "num" }, String(n)))));
    }
    S.$("excluded-section").hidden = !view.excluded_nodes.length;
    S.fill(S.$("excluded-rows"), view.excluded_nodes.map((e) =>
      S.el("tr", {}, S.el("td", { class: "mono" }, e.node_id.slice(0, 12)), S.el("td", { class: "wrap" }, e.why), S.el("td", {}, S.time(e.until)))));
  }

  async function load() {
    const [view, queues] = await Promise.all([S.json("/v1/cluster"), S.json("/v1/queues")]);
    render(view, queues);
    S.showMain();
  }

  let timer = null;

  async function start() {
    clearInterval(timer);
    await load();
    timer = setInterval(() => {
      load().catch((exc) => {
        if (exc.status === 401) clearInterval(timer); // the token form is up: it starts again with the new token
        else S.notice(`Could not refresh: ${exc.message}`);
      });
    }, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => S.run(start));
})();
