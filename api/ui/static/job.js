// The job view: its spec, state and timeline, attempts with their end reasons, every metric as a chart with one
// series per attempt (uPlot), checkpoints, and the current attempt's log, which follows by byte offset. The page's
// one stream is the job's own events; metrics and the log are read again every POLL_MS while the job is active.
"use strict";

(() => {
  const S = shunter;
  const POLL_MS = 2000;
  const MAX_LOG_CHARS = 1 << 20;
  const MAX_CHARTS = 12;
  const ANSI = /\x1b\[[0-9;?]*[A-Za-z]/g;
  const COLORS = ["#2458c6", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#1098ad", "#5c940d", "#e67700"];
  const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop() || "");
  const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
  const charts = {}; // metric name -> uPlot (window.shunterCharts, for whoever inspects the page)
  const holders = {}; // metric name -> its box on the page
  window.shunterCharts = charts;
  let job = null;
  let lastEvent = 0;
  let poller = null;
  let log = { attempt: 0, offset: null };
  let reloading = null;

  function dashboardBase() {
    const url = job && job.ray_dashboard_url ? S.safeUrl(job.ray_dashboard_url) : null;
    return url ? url.split("/#/")[0] : null;
  }

  function attemptUrl(submissionId) {
    const root = dashboardBase();
    return root ? `${root}/#/jobs/${encodeURIComponent(submissionId)}` : null;
  }

  function fact(name, value) {
    if (value === null || value === undefined || value === "" || (Array.isArray(value) && !value.length)) return [];
    return [S.el("dt", {}, name), S.el("dd", { "data-fact": name }, value)];
  }

  function renderJob() {
    S.fill(S.$("job-name"), job.name);
    S.fill(S.$("job-id"), job.id);
    S.fill(S.$("job-state"), S.stateBadge(job.state));
    document.title = `${job.name} · shunter`;
    const link = S.$("job-dashboard");
    const url = job.ray_dashboard_url ? S.safeUrl(job.ray_dashboard_url) : null;
    link.hidden = !url;
    if (url) link.href = url;
    S.$("job-cancel").hidden = !["QUEUED", "STARTING", "RUNNING"].includes(job.state);
    S.$("job-retry").hidden = !(job.state === "FAILED" || job.state === "CANCELLED");
    const position = job.position ? `${job.position.queue} in queue ${job.queue}, ${job.position.overall} overall` : "";
    const deps = (job.dependencies || []).map((d) => `${d.job} (${d.on}: ${d.status})`).join(", ");
    S.fill(
      S.$("job-facts"),
      fact("Owner", job.owner + (job.team ? ` (team ${job.team})` : "")),
      fact("Queue", job.queue),
      fact("Priority", String(job.priority)),
      fact("Attempt", String(job.attempt)),
      fact("Position", position),
      fact("Estimated start", S.time(job.estimated_start)),
      fact("Reason", job.state_reason),
      fact("End reason", job.end_reason),
      fact("Last error", job.last_error),
      fact("Workers", job.world_size === null ? "" : String(job.world_size)),
      fact("Step", job.step === null ? "" : String(job.step)),
      fact("Loss", S.num(job.loss)),
      fact("Latest checkpoint", job.latest_checkpoint),
      fact("Submitted", S.time(job.created_at)),
      fact("Started", S.time(job.started_at)),
      fact("Finished", S.time(job.finished_at)),
      fact("Depends on", deps),
      fact("Sweep", job.sweep_id ? `${job.sweep_id} #${job.sweep_index}` : ""),
      fact("Warnings", (job.warnings || []).join("; ")),
    );
    S.fill(S.$("job-spec"), JSON.stringify(job.spec, null, 2));
  }

  function renderAttempts(attempts) {
    S.fill(
      S.$("attempt-rows"),
      attempts.map((a) => {
        const url = attemptUrl(a.submission_id);
        const sub = url ? S.el("a", { href: url, class: "ext mono", target: "_blank", rel: "noopener noreferrer" }, a.submission_id) : S.el("span", { class: "mono" }, a.submission_id);
        return S.el(
          "tr",
          { "data-attempt": a.number },
          S.el("td", { class: "num" }, String(a.number)),
          S.el("td", {}, sub),
          S.el("td", {}, a.ray_status || ""),
          S.el("td", {}, S.time(a.started_at)),
          S.el("td", {}, S.time(a.ended_at)),
          S.el("td", {}, a.end_reason || (a.ended_at ? "" : "running")),
          S.el("td", { class: "wrap" }, a.message || ""),
        );
      }),
    );
  }

  function renderCheckpoints(rows) {
    S.fill(
      S.$("checkpoint-rows"),
      rows.map((c) =>
        S.el(
          "tr",
          { "data-checkpoint": c.id },
          S.el("td", { class: "num" }, String(c.id)),
          S.el("td", { class: "num" }, String(c.attempt)),
          S.el("td", { class: "num" }, c.step === null ? "" : String(c.step)),
          S.el("td", { class: c.complete ? "yes" : "no" }, (c.complete ? "complete" : "incomplete") + (c.pruned ? ", pruned" : "")),
          S.el("td", { class: "wrap mono" }, c.uri),
          S.el("td", { class: "wrap" }, c.metrics ? Object.entries(c.metrics).map(([k, v]) => `${k} ${S.num(v)}`).join(", ") : ""),
          S.el("td", {}, S.time(c.created_at)),
        ),
      ),
    );
  }

  function eventRow(e) {
    const change = e.kind === "state" ? `${e.from_state || "·"} → ${e.to_state}` : e.kind;
    return S.el(
      "tr",
      { "data-event": e.id },
      S.el("td", {}, S.time(e.at)),
      S.el("td", {}, change),
      S.el("td", {}, e.reason),
      S.el("td", { class: "wrap" }, e.message || ""),
      S.el("td", { class: "num" }, e.attempt === null ? "" : String(e.attempt)),
      S.el("td", {}, e.actor || ""),
    );
  }

  // uPlot data for one metric: x = the steps any attempt reported it at, one series per attempt (null where that
  // attempt has no point, so its line breaks there rather than joining attempts).
  function seriesData(points) {
    const attempts = [...new Set(points.map((p) => p.attempt))].sort((a, b) => a - b);
    const xs = [...new Set(points.map((p, i) => (p.step === null ? i : p.step)))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const ys = attempts.map(() => xs.map(() => null));
    points.forEach((p, i) => {
      ys[attempts.indexOf(p.attempt)][at.get(p.step === null ? i : p.step)] = p.value;
    });
    return { attempts, data: [xs, ...ys] };
  }

  function dropChart(name) {
    charts[name].destroy();
    holders[name].remove();
    delete charts[name];
    delete holders[name];
  }

  function renderMetrics(points) {
    const byName = new Map();
    for (const p of points) {
      if (!byName.has(p.name)) byName.set(p.name, []);
      byName.get(p.name).push(p);
    }
    const names = [...byName.keys()].sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a < b ? -1 : 1)).slice(0, MAX_CHARTS);
    S.$("no-metrics").hidden = names.length > 0;
    const box = S.$("charts");
    for (const name of Object.keys(charts)) {
      if (!names.includes(name)) dropChart(name);
    }
    for (const name of names) {
      const { attempts, data } = seriesData(byName.get(name));
      const existing = charts[name];
      if (existing && existing.series.length === attempts.length + 1) {
        existing.setData(data);
        continue;
      }
      if (existing) dropChart(name); // a new attempt: one more series
      const holder = S.el("div", { class: "chart", "data-metric": name }, S.el("h3", {}, name));
      box.append(holder);
      holders[name] = holder;
      const opts = {
        width: 560,
        height: 220,
        scales: { x: { time: false } },
        axes: [{ label: "step" }, {}],
        series: [
          { label: "step" },
          ...attempts.map((a, i) => ({ label: `attempt ${a}`, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false, points: { show: true, size: 5 } })),
        ],
      };
      charts[name] = new uPlot(opts, data, holder);
    }
  }

  async function readLog() {
    if (!job || job.attempt === 0) {
      S.fill(S.$("log-attempt"), "");
      return;
    }
    if (log.attempt !== job.attempt) {
      log = { attempt: job.attempt, offset: null };
      S.fill(S.$("logs"), "");
      S.fill(S.$("log-attempt"), `attempt ${job.attempt}`);
    }
    const query = log.offset === null ? "tail=1000" : `offset=${log.offset}`;
    const first = log.offset === null;
    try {
      const res = await S.api(`${base}/logs?attempt=${log.attempt}&${query}`);
      const text = (await res.text()).replace(ANSI, ""); // Ray's colour codes
      const next = Number(res.headers.get("X-Next-Offset"));
      if (Number.isFinite(next)) log.offset = next;
      if (text) {
        const pre = S.$("logs");
        const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        let all = pre.textContent + text;
        if (all.length > MAX_LOG_CHARS) all = all.slice(all.length - MAX_LOG_CHARS);
        pre.textContent = all;
        if (atBottom || first) pre.scrollTop = pre.scrollHeight;
      }
    } catch (exc) {
      if (exc.status === 401) throw exc; // the log of a running attempt is with Ray: a 503 just waits for the next poll
    }
  }

  async function readAll() {
    const asked = lastEvent;
    const [fresh, attempts, checkpoints, metrics] = await Promise.all([
      S.json(base),
      S.json(`${base}/attempts`),
      S.pages(`${base}/checkpoints`),
      S.json(`${base}/metrics?limit=100000`),
    ]);
    // Asked for before an event that came meanwhile, the read may be older than it: the event's state stays (its own
    // reload follows), as on the queue page.
    if (job && lastEvent !== asked) fresh.state = job.state;
    job = fresh;
    renderJob();
    renderAttempts(attempts);
    renderCheckpoints(checkpoints);
    renderMetrics(metrics);
    await readLog();
  }

  // Read everything again once (coalescing calls that come while one runs), and keep polling while the job is active.
  function reload() {
    if (reloading) {
      reloading.again = true;
      return;
    }
    reloading = { again: false };
    readAll()
      .catch((exc) => {
        if (exc.status !== 401) S.notice(`Could not refresh: ${exc.message}`);
      })
      .finally(() => {
        const again = reloading.again;
        reloading = null;
        if (again) reload();
        else schedule();
      });
  }

  function schedule() {
    clearTimeout(poller);
    poller = job && !S.TERMINAL.has(job.state) ? setTimeout(reload, POLL_MS) : null;
  }

  function onEvent(event) {
    if (event.id <= lastEvent) return;
    lastEvent = event.id;
    S.$("event-rows").append(eventRow(event));
    if (event.kind === "state" && job) {
      job.state = event.to_state;
      renderJob();
    }
    reload();
  }

  function followEvents() {
    if (!S.TERMINAL.has(job.state)) S.follow(`${base}/events`, { after: lastEvent, onEvent, untilEnd: true });
  }

  async function act(what, button) {
    if (what === "cancel" && button.dataset.armed !== "1") {
      button.dataset.armed = "1";
      S.fill(button, "Confirm cancel");
      setTimeout(() => {
        button.dataset.armed = "";
        S.fill(button, "Cancel");
      }, 5000);
      return;
    }
    button.disabled = true;
    S.fill(S.$("action-error"), "");
    try {
      await S.post(`${base}/${what}`);
      await readAll();
      if (what === "retry") followEvents(); // its stream had ended with the job
    } catch (exc) {
      S.fill(S.$("action-error"), `${what}: ${exc.message}`);
    } finally {
      button.disabled = false;
      button.dataset.armed = "";
      S.fill(button, what === "cancel" ? "Cancel" : "Retry");
    }
  }

  async function start() {
    const events = await S.pages(`${base}/events`);
    await readAll();
    S.fill(S.$("event-rows"), events.map(eventRow));
    lastEvent = events.length ? events[events.length - 1].id : 0;
    S.showMain();
    S.$("logs").scrollTop = S.$("logs").scrollHeight;
    followEvents();
    schedule();
  }

  document.addEventListener("DOMContentLoaded", () => {
    S.$("job-cancel").addEventListener("click", (e) => act("cancel", e.currentTarget));
    S.$("job-retry").addEventListener("click", (e) => act("retry", e.currentTarget));
    S.run(start);
  });
})();
