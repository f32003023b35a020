// shunter's web page, shared part: the API client (bearer token from sessionStorage, never in a URL), the one event
// stream a page holds (fetch, since an EventSource cannot send a header), DOM building that only ever sets text
// (never innerHTML: every name, reason, message and log line is user text), and formatting.
"use strict";

const shunter = (() => {
  const TOKEN_KEY = "shunter.token";
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
  const STATES = ["QUEUED", "STARTING", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"];

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail || `HTTP ${status}`);
      this.status = status;
    }
  }

  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }

  function headers(extra) {
    const h = Object.assign({ Accept: "application/json" }, extra || {});
    const t = token();
    if (t) h.Authorization = `Bearer ${t}`;
    return h;
  }

  async function detailOf(res) {
    try {
      const body = await res.json();
      return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (_) {
      return res.statusText;
    }
  }

  // One request to the API; a 401 asks for a token (and throws, so the caller stops), other errors throw the API's
  // own message.
  async function api(path, { method = "GET", body } = {}) {
    const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}), cache: "no-store" };
    init.credentials = "omit";
    if (body !== undefined) init.body = JSON.stringify(body);
    const res = await fetch(path, init);
    if (res.status === 401) {
      const detail = await detailOf(res);
      askForToken(token() ? `The token was refused: ${detail}` : "");
      throw new ApiError(401, detail);
    }
    if (!res.ok) throw new ApiError(res.status, await detailOf(res));
    return res;
  }

  async function json(path) {
    return (await api(path)).json();
  }

  // Every row of a paged list (a job's events or checkpoints): page after page, as X-Next-After names them.
  async function pages(path) {
    const rows = [];
    let url = path;
    for (;;) {
      const res = await api(url);
      rows.push(...(await res.json()));
      const next = res.headers.get("X-Next-After");
      if (!next) return rows;
      url = `${path}${path.includes("?") ? "&" : "?"}after=${encodeURIComponent(next)}`;
    }
  }

  function post(path) {
    return api(path, { method: "POST" }).then((res) => res.json());
  }

  // ---- DOM: elements with text children only ----
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "href") {
        const safe = safeUrl(value);
        if (safe) node.setAttribute("href", safe);
      } else if (key === "title") node.title = String(value);
      else if (key === "on") for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else if (key === "style") throw new Error("no inline styles (CSP)");
      else node.setAttribute(key, String(value));
    }
    append(node, children);
    return node;
  }

  function append(node, children) {
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fill(node, ...children) {
    node.replaceChildren();
    return append(node, children);
  }

  function $(id) {
    return document.getElementById(id);
  }

  // Only same-origin paths and http(s) links (a dashboard URL comes from the service's settings, but a
  // `javascript:` one must never become a link).
  function safeUrl(url) {
    try {
      const parsed = new URL(String(url), location.href);
      return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : null;
    } catch (_) {
      return null;
    }
  }

  function stateBadge(state) {
    return el("span", { class: `state ${STATES.includes(state) ? state : ""}`, "data-state": state }, state);
  }

  function jobLink(id) {
    return `/ui/jobs/${encodeURIComponent(id)}`;
  }

  // ---- formatting ----
  function pad(n) {
    return String(n).padStart(2, "0");
  }

  function time(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return String(iso);
    return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  }

  function num(value, digits = 4) {
    if (value === null || value === undefined || value === "") return "";
    const n = Number(value);
    if (!Number.isFinite(n)) return String(value);
    if (Number.isInteger(n)) return String(n);
    return Math.abs(n) >= 1000 ? n.toFixed(1) : n.toPrecision(digits);
  }

  function resources(map) {
    return Object.entries(map || {})
      .filter(([k]) => !k.startsWith("node:") && !k.startsWith("accelerator_type"))
      .map(([k, v]) => `${k} ${num(v, 3)}`)
      .join(", ");
  }

  // ---- the token ----
  let started = null; // the page's start function, run again once a token is given

  function askForToken(message) {
    stopStream();
    $("main").hidden = true;
    $("login").hidden = false;
    fill($("login-error"), message || "");
    $("token-input").focus();
  }

  function useToken() {
    const value = $("token-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("token-input").value = "";
    $("login").hidden = true;
    $("forget-token").hidden = false;
    if (started) run(started);
  }

  function forgetToken() {
    sessionStorage.removeItem(TOKEN_KEY);
    location.reload(); // nothing another token could see stays on the page
  }

  function notice(message) {
    const box = $("notice");
    box.hidden = !message;
    fill(box, message || "");
  }

  function showMain() {
    $("login").hidden = true;
    $("main").hidden = false;
  }

  async function run(start) {
    started = start;
    try {
      await start();
      notice("");
    } catch (exc) {
      if (exc instanceof ApiError && exc.status === 401) return; // askForToken has shown the form
      notice(`Could not load: ${exc.message}`);
    }
  }

  // ---- the one event stream of a page ----
  let stream = null;

  function setLive(on) {
    const badge = $("live");
    badge.classList.toggle("on", on);
    fill(badge, on ? "live" : "offline");
  }

  function stopStream() {
    if (stream) stream.stop();
    stream = null;
    setLive(false);
  }

  function sleep(ms, signal) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal.addEventListener("abort", () => {
        clearTimeout(timer);
        resolve();
      });
    });
  }

  // Follows `path` (/v1/events or a job's events) from event id `after`, calling `onEvent` for each; reconnects
  // where it left off when the server ends the stream (its deadline) unless `untilEnd` (a job's stream ends after
  // its terminal event: nothing more will come). Starting one stops the page's previous one first.
  function follow(path, { after = 0, onEvent, untilEnd = false }) {
    stopStream();
    const ctrl = new AbortController();
    const self = { last: after, stop: () => ctrl.abort() };
    stream = self;
    (async () => {
      let wait = 1000;
      while (!ctrl.signal.aborted) {
        try {
          const sep = path.includes("?") ? "&" : "?";
          const res = await fetch(`${path}${sep}follow=true&after=${self.last}`, {
            headers: headers({ Accept: "text/event-stream" }),
            cache: "no-store",
            credentials: "omit",
            signal: ctrl.signal,
          });
          if (res.status === 401) {
            askForToken(`The token was refused: ${await detailOf(res)}`);
            return;
          }
          if (res.ok) {
            setLive(true);
            wait = 1000;
            await readEvents(res.body, (event, id) => {
              if (id) self.last = Math.max(self.last, id);
              onEvent(event);
            });
            if (untilEnd) break;
          } else {
            const retry = Number(res.headers.get("Retry-After"));
            wait = Number.isFinite(retry) && retry > 0 ? retry * 1000 : Math.min(wait * 2, 30000);
            notice(`Live updates paused: ${await detailOf(res)}`);
          }
        } catch (_) {
          if (ctrl.signal.aborted) break;
          wait = Math.min(wait * 2, 30000);
        }
        if (stream === self) setLive(false);
        await sleep(wait, ctrl.signal);
      }
      if (stream === self) setLive(false);
    })();
    return self;
  }

  async function readEvents(body, onEvent) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let id = 0;
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("id:")) id = Number(line.slice(3).trim()) || 0;
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (!data.length) continue; // retry: and keepalive comments
        try {
          onEvent(JSON.parse(data.join("\n")), id);
        } catch (exc) {
          console.error("bad event", exc);
        }
      }
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("token-save").addEventListener("click", useToken);
    $("token-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter") useToken();
    });
    $("forget-token").addEventListener("click", forgetToken);
    $("forget-token").hidden = !token();
    const here = document.body.dataset.view === "cluster" ? "nav-cluster" : "nav-queue";
    $("live").hidden = document.body.dataset.view === "cluster"; // read by polling: no stream there
    $(here).classList.add("here");
  });

  return {
    ApiError, TERMINAL, STATES, api, json, pages, post, el, append, fill, $, safeUrl, stateBadge, jobLink, time, num,
    resources, run, showMain, notice, follow, stopStream,
  };
})();
