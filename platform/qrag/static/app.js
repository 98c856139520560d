// The qrag web page: ask a question over pasted text or an indexed corpus, then watch the
// retrieval steps (chosen chunk, Q, runner-ups) light up in the document, one step at a time.
"use strict";

const $ = (id) => document.getElementById(id);
const STEP_DELAY_MS = 350;
let last = null; // the last response, for "Replay steps"
let timers = [];

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

// The API key (servers with keys configured ask for one) lives only in this tab's session.
function headers() {
  const h = { "content-type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

async function api(path, options = {}) {
  const res = await fetch(path, { headers: headers(), ...options });
  const body = await res.json().catch(() => ({}));
  if (!res.ok) {
    const e = body.error || {};
    throw new Error(`${res.status}${e.field ? " (" + e.field + ")" : ""}: ${e.message || res.statusText}`);
  }
  return body;
}

async function loadHealth() {
  try {
    const h = await api("/healthz");
    const m = h.model;
    if (!m) { // a server with keys names its model only to a caller with a read key
      $("model").textContent = "model hidden: enter a read key";
      $("model").classList.remove("untrained");
      return;
    }
    $("model").textContent = `${m.trained ? "trained checkpoint" : "UNTRAINED encoder"} · positions ${m.positions} · ${m.fingerprint}`;
    $("model").classList.toggle("untrained", !m.trained);
    $("model").title = h.message;
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
}

async function loadCorpora() {
  const { corpora } = await api("/v1/corpora");
  const select = $("corpus");
  select.innerHTML = "";
  for (const c of corpora) {
    const opt = document.createElement("option");
    opt.value = c.name;
    opt.textContent = `${c.name} (${c.documents} docs, ${c.chunks} chunks)`;
    select.appendChild(opt);
  }
  $("corpus-info").textContent = corpora.length ? "" : "no corpus indexed yet (POST /v1/corpora)";
}

function chooseSource() {
  const corpus = $("use-corpus").checked;
  $("corpus-box").hidden = !corpus;
  $("context-box").hidden = corpus;
  if (corpus) loadCorpora().catch((e) => setStatus(e.message, true));
}

function request() {
  const body = {
    question: $("question").value,
    max_steps: parseInt($("max-steps").value, 10),
    beam_width: parseInt($("beam").value, 10),
    beam_score: $("beam-score").value,
    alternatives: 3,
  };
  const t = $("threshold").value.trim();
  if (t !== "") body.stop_threshold = Number(t);
  if ($("use-corpus").checked) body.corpus = $("corpus").value;
  else { body.context = $("context").value; body.return_chunks = true; }
  return body;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function renderDocument(res) {
  const doc = $("document");
  doc.innerHTML = "";
  if (res.chunks) { // inline context: the whole text, chunk by chunk
    res.chunks.forEach((text, i) => {
      const span = el("span", "chunk", text + " ");
      span.dataset.chunk = i;
      doc.appendChild(span);
    });
    return;
  }
  // a corpus: only the chunks the search touched, grouped by document, in corpus order
  const seen = new Map();
  for (const s of res.steps) for (const c of [s, ...s.alternatives]) seen.set(c.chunk_id, c);
  let docId = null;
  for (const c of [...seen.values()].sort((a, b) => a.chunk_id - b.chunk_id)) {
    if (c.doc_id !== docId) { docId = c.doc_id; doc.appendChild(el("div", "doc-head", `document ${docId}`)); }
    const span = el("span", "chunk", c.text + " ");
    span.dataset.chunk = c.chunk_id;
    doc.appendChild(span);
    doc.appendChild(el("span", "muted", "… "));
  }
}

function renderSteps(res) {
  const list = $("steps");
  list.innerHTML = "";
  res.steps.forEach((s) => {
    const li = el("li", "step pending");
    li.dataset.chunk = s.chunk_id;
    li.dataset.q = s.q;
    const pos = s.position === null ? "" : ` · position ${s.position.toFixed(2)}`;
    li.appendChild(el("div", "step-head", `chunk ${s.chunk_id} · Q ${s.q.toFixed(4)}${pos} · doc ${s.doc_id}`));
    li.appendChild(el("div", "step-text", s.text));
    const alts = el("ul", "alts");
    for (const a of s.alternatives) {
      const item = el("li", "alt", `alternative: chunk ${a.chunk_id} · Q ${a.q.toFixed(4)} — ${a.text.slice(0, 90)}`);
      item.dataset.chunk = a.chunk_id;
      alts.appendChild(item);
    }
    li.appendChild(alts);
    list.appendChild(li);
  });
}

function showStep(res, i) {
  const s = res.steps[i];
  document.querySelectorAll("#document .chunk.alt").forEach((n) => n.classList.remove("alt"));
  for (const a of s.alternatives) {
    const n = document.querySelector(`#document .chunk[data-chunk="${a.chunk_id}"]`);
    if (n && !n.classList.contains("chosen")) n.classList.add("alt");
  }
  const node = document.querySelector(`#document .chunk[data-chunk="${s.chunk_id}"]`);
  if (node) {
    node.classList.add("chosen");
    node.prepend(el("span", "badge", String(i + 1)));
    if (i === 0) node.scrollIntoView({ block: "center" });
  }
  $("steps").children[i].classList.remove("pending");
  if (i === res.steps.length - 1) {
    const t = res.timings;
    setStatus(`${res.steps.length} step(s)${res.stopped_early ? " (stopped early: Q below threshold)" : ""} over ${res.n_chunks} chunks in ${t.total_ms.toFixed(1)} ms`
      + ` (encode ${t.encode_ms.toFixed(1)}, score ${t.score_ms.toFixed(1)}, merge ${t.merge_ms.toFixed(1)})`);
    document.body.dataset.done = "1";
  }
}

function play(res) {
  timers.forEach(clearTimeout);
  timers = [];
  document.body.dataset.done = "";
  renderDocument(res);
  renderSteps(res);
  if (!res.steps.length) { setStatus("no chunk selected (every Q below the threshold)"); document.body.dataset.done = "1"; return; }
  res.steps.forEach((_, i) => timers.push(setTimeout(() => showStep(res, i), STEP_DELAY_MS * (i + 1))));
}

async function ask() {
  setStatus("retrieving…");
  $("ask").disabled = true;
  try {
    last = await api("/v1/retrieve", { method: "POST", body: JSON.stringify(request()) });
    $("replay").disabled = false;
    play(last);
  } catch (e) {
    setStatus(e.message, true);
  } finally {
    $("ask").disabled = false;
  }
}

$("use-context").addEventListener("change", chooseSource);
$("use-corpus").addEventListener("change", chooseSource);
$("ask").addEventListener("click", ask);
$("replay").addEventListener("click", () => last && play(last));
$("question").addEventListener("keydown", (e) => { if (e.key === "Enter") ask(); });
$("file").addEventListener("change", async (e) => {
  const file = e.target.files[0];
  if (file) $("context").value = await file.text();
});
$("api-key").value = sessionStorage.getItem("qrag-api-key") || "";
// A new key may unlock the model's details and the corpus list: ask again once typing pauses.
let keyTimer = null;
$("api-key").addEventListener("input", () => {
  clearTimeout(keyTimer);
  keyTimer = setTimeout(() => {
    sessionStorage.setItem("qrag-api-key", $("api-key").value.trim());
    loadHealth();
    if ($("use-corpus").checked) chooseSource();
  }, 300);
});
loadHealth();
