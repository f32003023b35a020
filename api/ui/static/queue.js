// The queue view: one plain GET /v1/jobs renders the list, then the page follows /v1/events from the id that listing
// was read at (X-Events-After) and moves rows as their jobs change.
"use strict";

(() => {
  const S = shunter;
  const LIST = "/v1/jobs?limit=500&positions=true";
  const ORDER = { RUNNING: 0, STARTING: 1, CANCELLING: 2, QUEUED: 3 };
  const jobs = new Map(); // id -> JobPublic
  const rows = new Map(); // id -> [signature, <tr>]
  const refreshing = new Set();
  // State events applied, per job. A read of the job (the list, or the job alone) asked for before the job's latest
  // one may be older than it: its state is not taken (the event's own refresh reads the job again). Under load a
  // relist answered after a cancel's event showed the cancelled job QUEUED again, then CANCELLED.
  const changes = new Map(); // id -> count
  let refreshTimer = null;
  let relistTimer = null;

  function rank(job) {
    return job.state in ORDER ? ORDER[job.state] : 4;
  }

  function compare(a, b) {
    const r = rank(a) - rank(b);
    if (r) return r;
    if (a.state === "QUEUED") {
      const pa = a.position ? a.position.overall : Infinity;
      const pb = b.position ? b.position.overall : Infinity;
      if (pa !== pb) return pa - pb;
      if (a.priority !== b.priority) return b.priority - a.priority;
      return a.created_at < b.created_at ? -1 : 1;
    }
    const ta = a.finished_at || a.started_at || a.created_at;
    const tb = b.finished_at || b.started_at || b.created_at;
    return ta < tb ? 1 : ta > tb ? -1 : 0;
  }

  function reason(job) {
    if (S.TERMINAL.has(job.state)) {
      return [job.end_reason, job.last_error].filter(Boolean).join(": ") || job.state_reason || "";
    }
    return job.state_reason || "";
  }

  function position(job) {
    if (job.state !== "QUEUED" || !job.position) return "";
    return [String(job.position.queue), S.el("span", { class: "muted" }, ` (${job.position.overall} overall)`)];
  }

  function actionButton(job) {
    if (["QUEUED", "STARTING", "RUNNING"].includes(job.state)) {
      return S.el("button", { type: "button", class: "danger", "data-action": "cancel", on: { click: (e) => act(e, job, "cancel") } }, "Cancel");
    }
    if (job.state === "FAILED" || job.state === "CANCELLED") {
      return S.el("button", { type: "button", "data-action": "retry", on: { click: (e) => act(e, job, "retry") } }, "Retry");
    }
    return null;
  }

  // A cancel asks to be clicked twice (the label says so for a few seconds): a multi-day run is not lost to a slip.
  async function act(event, job, what) {
    const button = event.currentTarget;
    if (what === "cancel" && button.dataset.armed !== "1") {
      button.dataset.armed = "1";
      S.fill(button, "Confirm cancel");
      setTimeout(() => {
        if (button.isConnected) {
          button.dataset.armed = "";
          S.fill(button, "Cancel");
        }
      }, 5000);
      return;
    }
    button.disabled = true;
    try {
      const answer = await S.post(`/v1/jobs/${encodeURIComponent(job.id)}/${what}`);
      S.notice("");
      const known = jobs.get(job.id);
      if (known) {
        known.state = answer.state;
        update();
      }
      scheduleRefresh(job.id);
    } catch (exc) {
      S.notice(`${what} ${job.id}: ${exc.message}`);
      button.disabled = false;
    }
  }

  function rowOf(job) {
    return S.el(
      "tr",
      { "data-job-id": job.id },
      S.el("td", {}, S.el("a", { class: "name", href: S.jobLink(job.id) }, job.name), S.el("span", { class: "id mono" }, job.id)),
      S.el("td", {}, job.owner),
      S.el("td", {}, job.queue),
      S.el("td", { class: "num" }, String(job.priority)),
      S.el("td", { class: "state-cell" }, S.stateBadge(job.state)),
      S.el("td", { class: "num" }, position(job)),
      S.el("td", { class: "reason" }, reason(job)),
      S.el("td", { class: "num" }, String(job.attempt)),
      S.el("td", { class: "num" }, job.step === null || job.step === undefined ? "" : String(job.step)),
      S.el("td", { class: "num" }, S.num(job.loss)),
      S.el("td", {}, S.time(job.created_at)),
      S.el("td", {}, actionButton(job)),
    );
  }

  function signature(job) {
    return JSON.stringify([job.state, job.state_reason, job.position, job.attempt, job.step, job.loss, job.end_reason, job.last_error, job.name]);
  }

  function options(select, values) {
    const keep = select.value;
    const fixed = [...select.options].filter((o) => o.dataset.fixed === "1" || o.value === "" || o.value === "active");
    select.replaceChildren(...fixed);
    for (const v of values) select.append(S.el("option", { value: v }, v));
    select.value = values.includes(keep) || fixed.some((o) => o.value === keep) ? keep : "";
  }

  function visible(job) {
    const state = S.$("f-state").value;
    if (state === "active" && S.TERMINAL.has(job.state)) return false;
    if (state && state !== "active" && job.state !== state) return false;
    const queue = S.$("f-queue").value;
    if (queue && job.queue !== queue) return false;
    const owner = S.$("f-owner").value;
    if (owner && job.owner !== owner) return false;
    const text = S.$("f-text").value.trim().toLowerCase();
    return !text || job.name.toLowerCase().includes(text) || job.id.toLowerCase().includes(text);
  }

  // Keyed update: a row is rebuilt only when its job changed, and rows are moved (not recreated) into order.
  function update() {
    const all = [...jobs.values()];
    options(S.$("f-queue"), [...new Set(all.map((j) => j.queue))].sort());
    options(S.$("f-owner"), [...new Set(all.map((j) => j.owner))].sort());
    const counts = {};
    for (const j of all) counts[j.state] = (counts[j.state] || 0) + 1;
    S.fill(S.$("counts"), S.STATES.filter((s) => counts[s]).map((s) => S.el("span", { "data-count": s }, `${s} ${counts[s]}`)));
    const body = S.$("job-rows");
    const shown = all.filter(visible).sort(compare);
    const keep = new Set(shown.map((j) => j.id));
    for (const [id, [, tr]] of rows) {
      if (!keep.has(id)) {
        tr.remove();
        rows.delete(id);
      }
    }
    shown.forEach((job, i) => {
      const sig = signature(job);
      let entry = rows.get(job.id);
      if (!entry || entry[0] !== sig) {
        const tr = rowOf(job);
        if (entry) entry[1].replaceWith(tr);
        entry = [sig, tr];
        rows.set(job.id, entry);
      }
      if (body.children[i] !== entry[1]) body.insertBefore(entry[1], body.children[i] || null);
    });
    S.$("empty").hidden = shown.length > 0;
  }

  function scheduleRefresh(id) {
    refreshing.add(id);
    if (!refreshTimer) refreshTimer = setTimeout(refresh, 250);
  }

  // The rows an event touched, read again (step, loss, reasons); many at once: the whole list instead.
  async function refresh() {
    refreshTimer = null;
    const ids = [...refreshing];
    refreshing.clear();
    if (ids.length > 20) return relist();
    await Promise.all(
      ids.map(async (id) => {
        const asked = changes.get(id);
        try {
          const job = await S.json(`/v1/jobs/${encodeURIComponent(id)}`);
          if (changes.get(id) !== asked) return; // a newer event came meanwhile: its own refresh follows
          const old = jobs.get(id);
          if (old && old.position && job.state === "QUEUED" && !job.position) job.position = old.position;
          jobs.set(id, job);
        } catch (exc) {
          if (exc.status === 404) jobs.delete(id); // gone from this caller's view
        }
      }),
    );
    update();
  }

  function scheduleRelist() {
    if (!relistTimer) relistTimer = setTimeout(relist, 2000);
  }

  // Positions shift for every queued job when one enters or leaves the queue: read the list again (not the stream).
  async function relist() {
    relistTimer = null;
    const asked = new Map(changes);
    try {
      const page = await S.json(LIST);
      const fresh = new Map(page.items.map((j) => [j.id, j]));
      for (const id of [...jobs.keys()]) if (!fresh.has(id) && !S.TERMINAL.has(jobs.get(id).state)) jobs.delete(id);
      for (const [id, job] of fresh) if (changes.get(id) === asked.get(id)) jobs.set(id, job); // else: as above
      update();
    } catch (_) {
      /* the next event tries again */
    }
  }

  function onEvent(event) {
    const job = jobs.get(event.job_id);
    if (event.kind === "state" && event.to_state) changes.set(event.job_id, (changes.get(event.job_id) || 0) + 1);
    if (job && event.kind === "state" && event.to_state) {
      const wasQueued = job.state === "QUEUED";
      job.state = event.to_state;
      job.state_reason = event.message || event.reason;
      if (event.attempt !== null && event.attempt !== undefined) job.attempt = event.attempt;
      if (job.state !== "QUEUED") job.position = null;
      if (wasQueued !== (job.state === "QUEUED")) scheduleRelist();
      update();
    } else if (!job) {
      scheduleRelist(); // a job this page has not listed yet (a new submission)
    }
    scheduleRefresh(event.job_id);
  }

  async function start() {
    const res = await S.api(LIST);
    const after = Number(res.headers.get("X-Events-After") || "0");
    const page = await res.json();
    jobs.clear();
    for (const job of page.items) jobs.set(job.id, job);
    S.$("more").hidden = !page.next_cursor;
    S.showMain();
    update();
    S.follow("/v1/events", { after, onEvent });
  }

  document.addEventListener("DOMContentLoaded", () => {
    const states = S.$("f-state");
    for (const s of S.STATES) states.append(S.el("option", { value: s, "data-fixed": "1" }, s));
    for (const id of ["f-state", "f-queue", "f-owner"]) S.$(id).addEventListener("change", update);
    S.$("f-text").addEventListener("input", update);
    S.run(start);
  });
})();
