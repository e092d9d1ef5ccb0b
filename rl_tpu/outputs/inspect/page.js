// The rollout inspector's script: reads the embedded data (rl_tpu/outputs/inspect/data.py), draws the step list, the
// selected step's groups and samples token by token, the filters and the two-step comparison. Every text of a sample
// goes in as textContent, never as markup.
"use strict";

const DATA = JSON.parse(document.getElementById("inspect-data").textContent);
const SAMPLES = new Map(DATA.samples.map((s) => [s.id, s]));
const state = { step: null, split: "train", measure: "gap", pinned: null };

// an environment token (a tool's reply) was not sampled: it has no engine logprob, so no gap
function sampled(s, j) {
  if (s.sampled === undefined) {
    s.sampled = new Uint8Array(s.n).fill(1);
    for (const turn of s.turns || []) if (turn.role === "environment") s.sampled.fill(0, turn.start, turn.end);
  }
  return s.sampled[j] === 1;
}

// each measure: its value at token j of sample s (null: not recorded), and whether it has a sign
const MEASURES = {
  gap: { signed: true, at: (s, j) => (s.tlp && s.lp && sampled(s, j) ? s.tlp[j] - s.lp[j] : null) },
  adv: { signed: true, at: (s, j) => (s.adv ? s.adv[j] : null) },
  ent: { signed: false, at: (s, j) => (s.ent ? s.ent[j] : null) },
  lp: { signed: false, at: (s, j) => (s.lp && sampled(s, j) ? -s.lp[j] : null) },
  none: { signed: false, at: () => null },
};
const POSITIVE = [214, 69, 65], NEGATIVE = [49, 110, 204], SEQUENTIAL = [128, 70, 190];

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (value !== 0 && Math.abs(value) < 10 ** -digits) return value.toExponential(1);
  return value.toFixed(digits);
}

function stepSamples(step, split) {
  return DATA.samples.filter((s) => s.step === step && s.split === split);
}

function isTruncated(s) {
  return s.truncated !== null && s.truncated !== undefined;
}

function outcomeOf(s) {
  return s.outcome !== null && s.outcome !== undefined ? s.outcome : s.finish;
}

// ---- filters ----
function numberInput(id) {
  const text = document.getElementById(id).value;
  return text === "" ? null : Number(text);
}

function filters() {
  return {
    rewardMin: numberInput("reward-min"),
    rewardMax: numberInput("reward-max"),
    lengthMin: numberInput("length-min"),
    lengthMax: numberInput("length-max"),
    outcome: document.getElementById("outcome").value,
    tools: document.getElementById("tools").value,
    truncation: document.getElementById("truncation").value,
    search: document.getElementById("search").value.trim().toLowerCase(),
  };
}

function passes(s, f) {
  const reward = s.reward === null ? NaN : s.reward;
  if (f.rewardMin !== null && !(reward >= f.rewardMin)) return false;
  if (f.rewardMax !== null && !(reward <= f.rewardMax)) return false;
  if (f.lengthMin !== null && s.n < f.lengthMin) return false;
  if (f.lengthMax !== null && s.n > f.lengthMax) return false;
  if (f.outcome && String(outcomeOf(s)) !== f.outcome) return false;
  if (f.tools === "yes" && !(s.tool_calls > 0)) return false;
  if (f.tools === "no" && s.tool_calls > 0) return false;
  if (f.truncation === "yes" && !isTruncated(s)) return false;
  if (f.truncation === "no" && isTruncated(s)) return false;
  if (f.search && !(s.prompt + "\n" + s.output).toLowerCase().includes(f.search)) return false;
  return true;
}

// ---- colours ----
function scaleOf(samples) {
  const measure = MEASURES[state.measure];
  let largest = 0;
  for (const s of samples) {
    for (let j = 0; j < s.n; j++) {
      if (s.mask && !s.mask[j]) continue; // greyed, not coloured
      const v = measure.at(s, j);
      if (v !== null && Number.isFinite(v)) largest = Math.max(largest, Math.abs(v));
    }
  }
  return largest;
}

function colour(value, largest, signed) {
  if (value === null || !Number.isFinite(value) || largest === 0) return "";
  const share = Math.min(1, Math.abs(value) / largest);
  const rgb = !signed ? SEQUENTIAL : value >= 0 ? POSITIVE : NEGATIVE;
  return `rgba(${rgb[0]},${rgb[1]},${rgb[2]},${(0.08 + 0.72 * share).toFixed(3)})`;
}

function drawLegend(largest) {
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  const measure = MEASURES[state.measure];
  if (state.measure === "none") return;
  if (largest === 0) {
    legend.append(el("span", "note", "not recorded for these tokens"));
    return;
  }
  const swatch = (value) => {
    const box = el("span", "swatch");
    box.style.background = colour(value, largest, measure.signed);
    return box;
  };
  if (measure.signed) legend.append(swatch(-largest), el("span", "", `−${fmt(largest)}`));
  legend.append(swatch(largest), el("span", "", `${measure.signed ? "+" : ""}${fmt(largest)}`));
  legend.append(el("span", "note", state.measure === "lp" ? "(darker: less likely)" : ""));
  const masked = el("span", "tok masked", " masked ");
  legend.append(masked, el("span", "", "out of the loss"));
}

// ---- a sample's tokens ----
function toolLabel(tools) {
  const label = el("div", "tool-label");
  const calls = (tools || []).map((t) => `${t.name} (${t.status})`);
  label.textContent = calls.length ? `tool: ${calls.join(", ")}` : "environment";
  if ((tools || []).some((t) => t.status !== "ok")) label.classList.add("failed");
  return label;
}

function drawTokens(s, largest) {
  const box = el("div", "tokens");
  if (!s.tokens) {
    box.append(el("span", "", s.output));
    return box;
  }
  const measure = MEASURES[state.measure];
  const turns = s.turns && s.turns.length ? s.turns : [{ role: "model", start: 0, end: s.n }];
  for (const turn of turns) {
    const tool = turn.role === "environment";
    const part = el(tool ? "div" : "span", tool ? "turn tool-turn" : "turn model-turn");
    if (tool) part.append(toolLabel(turn.tools));
    for (let j = turn.start; j < turn.end; j++) {
      const piece = s.tokens[j];
      const tok = el("span", "tok", piece.replace(/\n/g, ""));
      tok.dataset.s = s.id;
      tok.dataset.j = j;
      if (piece.includes("\n")) tok.classList.add("nl");
      if (s.mask && !s.mask[j]) tok.classList.add("masked");
      else tok.style.background = colour(measure.at(s, j), largest, measure.signed);
      part.append(tok);
      if (piece.includes("\n")) part.append(document.createTextNode("\n"));
    }
    box.append(part);
  }
  if (isTruncated(s)) box.append(el("span", "trunc-mark", `✂ cut: ${s.truncated}`));
  return box;
}

function drawSample(s, largest) {
  const row = el("div", "sample");
  row.dataset.id = s.id;
  row.dataset.len = s.n;
  row.dataset.line = s.line;
  const figures = el("div", "figures");
  const reward = el("span", "reward " + (s.reward > 0 ? "pos" : s.reward < 0 ? "neg" : ""), `reward ${fmt(s.reward)}`);
  figures.append(reward, el("span", "", `  adv ${fmt(s.advantage)}`), el("br"));
  figures.append(el("span", "", `${outcomeOf(s)} · ${s.n} tokens${s.tool_calls ? ` · ${s.tool_calls} tool calls` : ""}`));
  const parts = Object.entries(s.parts).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
  const meta = [`weights v${s.version}`, `finish ${s.finish}`, parts && `parts: ${parts}`, s.answer !== null && `answer: ${JSON.stringify(s.answer)}`];
  figures.append(el("div", "meta", meta.filter(Boolean).join(" · ")));
  row.append(figures, drawTokens(s, largest));
  return row;
}

function drawGroup(samples, largest) {
  const group = el("div", "group");
  const first = samples[0];
  group.dataset.group = first.group;
  const head = el("div", "group-head");
  const mean = samples.reduce((sum, s) => sum + (s.reward || 0), 0) / samples.length;
  head.append(el("b", "", first.split === "eval" ? `prompt ${first.index}` : `group ${first.group}`));
  head.append(el("div", "prompt", first.prompt));
  head.append(el("span", "", `truth ${first.gts ?? "–"} · mean reward ${fmt(mean)}`));
  group.append(head);
  for (const s of samples) group.append(drawSample(s, largest));
  return group;
}

// ---- the step view ----
function drawStep() {
  const all = stepSamples(state.step, state.split);
  const f = filters();
  const shown = all.filter((s) => passes(s, f));
  const largest = scaleOf(shown);
  drawLegend(largest);
  const groups = new Map();
  for (const s of shown) {
    const key = s.split === "eval" ? s.index : s.group;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(s);
  }
  const box = document.getElementById("groups");
  box.replaceChildren();
  for (const samples of groups.values()) box.append(drawGroup(samples, largest));
  if (!all.length) box.append(el("div", "note", `step ${state.step}: no ${state.split === "eval" ? "evaluation" : "training"} samples recorded`));
  document.getElementById("shown-count").textContent = `${shown.length} of ${all.length} samples`;
  for (const item of document.querySelectorAll(".step-item")) {
    item.classList.toggle("selected", Number(item.dataset.step) === state.step);
  }
}

function fillOutcomes() {
  const select = document.getElementById("outcome");
  const values = [...new Set(DATA.samples.map((s) => String(outcomeOf(s))))].sort();
  for (const value of values) select.append(new Option(value, value));
}

function drawStepList() {
  const body = document.getElementById("step-list");
  for (const step of DATA.steps) {
    const row = el("tr", "step-item");
    row.dataset.step = step.step;
    const recorded = step.train + step.eval;
    if (!recorded) row.classList.add("empty");
    const counts = el("td", "counts");
    for (const [name, count] of Object.entries(step.counts)) counts.append(el("span", "badge", `${name} ${count}`));
    const acc = step.accuracy === null || step.accuracy === undefined ? "" : `${(100 * step.accuracy).toFixed(1)}%`;
    row.append(el("td", "", step.step), el("td", "", fmt(step.reward)), el("td", "", acc));
    row.append(el("td", "", `${step.train}${step.eval ? ` + ${step.eval} eval` : ""}`), counts);
    row.addEventListener("click", () => selectStep(step.step));
    body.append(row);
  }
}

function selectStep(step) {
  state.step = step;
  const info = DATA.steps.find((s) => s.step === step);
  if (info && !info[state.split] && info[state.split === "train" ? "eval" : "train"]) {
    state.split = state.split === "train" ? "eval" : "train";
    document.getElementById("split").value = state.split;
  }
  drawStep();
}

// ---- a token's figures ----
function showToken(tok) {
  const s = SAMPLES.get(Number(tok.dataset.s));
  const j = Number(tok.dataset.j);
  const detail = document.getElementById("token-detail");
  const gap = MEASURES.gap.at(s, j);
  const role = (s.turns || []).find((t) => t.start <= j && j < t.end);
  const rows = [
    ["token", `${j + 1} of ${s.n}`],
    ["text", JSON.stringify(s.tokens[j])],
    ["id", s.ids ? s.ids[j] : null],
    ["in the loss", s.mask ? (s.mask[j] ? "yes" : "no") : "–"],
    ["engine logprob", s.lp && sampled(s, j) ? fmt(s.lp[j], 6) : null],
    ["trainer logprob", s.tlp ? fmt(s.tlp[j], 6) : null],
    ["gap (trainer − engine)", gap === null ? null : fmt(gap, 6)],
    ["advantage", s.adv ? fmt(s.adv[j], 4) : null],
    ["entropy", s.ent ? fmt(s.ent[j], 4) : null],
    ["turn", role ? role.role : "model"],
    ["step · sample", `${s.step} · ${s.split} #${s.id}`],
  ];
  const table = el("table");
  for (const [name, value] of rows) {
    const tr = el("tr");
    tr.append(el("td", "", name), el("td", "", value ?? "not recorded"));
    table.append(tr);
  }
  detail.replaceChildren(table);
  detail.hidden = false;
}

document.addEventListener("mouseover", (event) => {
  const tok = event.target.closest && event.target.closest(".tok[data-s]");
  if (tok && !state.pinned) showToken(tok);
});
document.addEventListener("click", (event) => {
  const tok = event.target.closest && event.target.closest(".tok[data-s]");
  if (!tok) return;
  if (state.pinned) state.pinned.classList.remove("pinned");
  state.pinned = state.pinned === tok ? null : tok;
  if (state.pinned) tok.classList.add("pinned");
  showToken(tok);
});

// ---- the same prompt at two steps ----
function comparable() {
  const split = document.getElementById("compare-split").value;
  return DATA.steps.filter((s) => s[split] > 0).map((s) => s.step);
}

function fillCompareSteps() {
  const steps = comparable();
  for (const [id, pick] of [["compare-a", 0], ["compare-b", steps.length - 1]]) {
    const select = document.getElementById(id);
    select.replaceChildren(...steps.map((step) => new Option(`step ${step}`, step)));
    if (steps.length) select.value = steps[pick];
  }
  fillComparePrompts();
}

function fillComparePrompts() {
  const split = document.getElementById("compare-split").value;
  const a = Number(document.getElementById("compare-a").value);
  const b = Number(document.getElementById("compare-b").value);
  const atB = new Set(stepSamples(b, split).map((s) => s.index));
  const shared = [...new Set(stepSamples(a, split).map((s) => s.index))].filter((index) => atB.has(index));
  const select = document.getElementById("compare-prompt");
  select.replaceChildren(...shared.map((index) => new Option(`row ${index}`, index)));
  drawCompare();
}

function drawCompare() {
  const split = document.getElementById("compare-split").value;
  const box = document.getElementById("compare");
  box.replaceChildren();
  const index = Number(document.getElementById("compare-prompt").value);
  if (document.getElementById("compare-prompt").value === "") {
    box.append(el("div", "note", "no prompt was recorded at both steps"));
    return;
  }
  for (const id of ["compare-a", "compare-b"]) {
    const step = Number(document.getElementById(id).value);
    const samples = stepSamples(step, split).filter((s) => s.index === index);
    const column = el("div", "compare-column");
    column.append(el("h3", "", `step ${step}`), drawGroup(samples, scaleOf(samples)));
    box.append(column);
  }
}

// ---- start ----
function start() {
  document.getElementById("run-name").textContent = DATA.run;
  const left = DATA.cap.left_out;
  document.getElementById("summary").textContent =
    `${DATA.steps.length} steps, ${DATA.samples.length} recorded samples shown` +
    (left ? ` (${left} more left out: at most ${DATA.cap.max_rows} samples and ${DATA.cap.max_tokens} tokens a page)` : "");
  drawStepList();
  fillOutcomes();
  for (const id of ["reward-min", "reward-max", "length-min", "length-max", "search"]) {
    document.getElementById(id).addEventListener("input", drawStep);
  }
  for (const id of ["outcome", "tools", "truncation"]) document.getElementById(id).addEventListener("change", drawStep);
  document.getElementById("measure").addEventListener("change", (event) => {
    state.measure = event.target.value;
    drawStep();
    drawCompare();
  });
  document.getElementById("split").addEventListener("change", (event) => {
    state.split = event.target.value;
    drawStep();
  });
  document.getElementById("compare-split").addEventListener("change", fillCompareSteps);
  document.getElementById("compare-a").addEventListener("change", fillComparePrompts);
  document.getElementById("compare-b").addEventListener("change", fillComparePrompts);
  document.getElementById("compare-prompt").addEventListener("change", drawCompare);
  const recorded = DATA.steps.filter((s) => s.train > 0);
  const first = recorded.length ? recorded[recorded.length - 1] : DATA.steps[DATA.steps.length - 1];
  if (first) selectStep(first.step);
  if (!comparable().length) document.getElementById("compare-split").value = "train";
  fillCompareSteps();
  window.inspectReady = { ms: performance.now() };
}

start();
