// The Gangway console: one page, hash routes, no dependencies. Everything it
// shows comes from /ui/api/ (the gRPC API's own handlers, as this user), and
// every value is put into the page as text, never as markup.
'use strict';

const FEED_MAX = 500;          // events the feed keeps in memory
const REFRESH_DEBOUNCE_MS = 2000; // at most one reload of a page per 2 s from events
const POLL_MS = 5000;          // reload period when the event stream is refused

const JOB_PENDING_MAX = 200;  // a job's live events kept while its page loads
const state = { me: null, feed: [], page: null, jobId: null, jobPending: [], timer: null, stream: null, refreshing: false };

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k === 'dataset') Object.assign(e.dataset, v);
    // Through the CSSOM: the policy forbids style attributes in markup.
    else if (k === 'style') e.style.cssText = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of kids.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function toast(msg, bad) {
  const t = document.getElementById('toast');
  t.textContent = msg;
  t.className = bad ? 'show bad' : 'show';
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.className = ''; }, 6000);
}

class LoginNeeded extends Error {}

async function api(path, opts) {
  const o = opts || {};
  const init = { credentials: 'same-origin', method: o.method || 'GET', headers: {} };
  if (init.method === 'POST') {
    init.headers['x-gangway-csrf'] = '1';
    init.headers['content-type'] = 'application/json';
    init.body = JSON.stringify(o.body || {});
  }
  const r = await fetch(path, init);
  let body;
  try { body = await r.json(); } catch (_) { body = { error: r.status + ' ' + r.statusText }; }
  if (r.status === 401 && !o.noLogin) { showLogin(body); throw new LoginNeeded(body.error); }
  if (!r.ok) throw new Error(body.error || (r.status + ' ' + r.statusText));
  return body;
}

// ------------------------------------------------------------------ formats

function dur(ms) {
  if (ms === null || ms === undefined || ms < 0) return '';
  let s = Math.floor(ms / 1000);
  const d = Math.floor(s / 86400); s %= 86400;
  const h = Math.floor(s / 3600); s %= 3600;
  const m = Math.floor(s / 60); s %= 60;
  const two = (n) => String(n).padStart(2, '0');
  return (d ? d + '-' : '') + (d || h ? two(h) + ':' : '') + two(m) + ':' + two(s);
}
function when(ms) { return ms ? new Date(ms).toLocaleString() : ''; }
function gib(mb) { return mb >= 1024 ? (mb / 1024).toFixed(mb % 1024 ? 1 : 0) + ' GiB' : mb + ' MiB'; }
function badge(s) { return el('span', { class: 'badge s-' + String(s).toLowerCase() }, s); }
function jobLink(id, text) { return el('a', { href: '#/jobs/' + Number(id) }, text === undefined ? String(id) : text); }

function mayChange(job) {
  const me = state.me;
  return !!me && (me.admin || me.operator || me.insecure || job.user === me.user);
}

function actions(job, after) {
  if (!mayChange(job)) return el('span', { class: 'muted' }, '');
  const b = [];
  const act = (name, label) => el('button', {
    class: 'act act-' + name, dataset: { action: name, job: String(job.id) },
    onclick: (ev) => { ev.preventDefault(); doAction(job, name, after); },
  }, label);
  if (job.state === 'PENDING') {
    b.push(job.held ? act('release', 'Release') : act('hold', 'Hold'));
  }
  if (['PENDING', 'RUNNING', 'SUSPENDED'].includes(job.state)) b.push(act('cancel', 'Cancel'));
  return el('span', { class: 'actions' }, b);
}

async function doAction(job, name, after) {
  if (name === 'cancel' && !window.confirm('Cancel job ' + job.display_id + ' (' + job.name + ')?')) return;
  try {
    await api('/ui/api/jobs/' + Number(job.id) + '/' + name, { method: 'POST' });
    toast('job ' + job.display_id + ': ' + name + ' done');
  } catch (e) {
    if (!(e instanceof LoginNeeded)) toast('job ' + job.display_id + ': ' + e.message, true);
  }
  if (after) after();
}

// ------------------------------------------------------------------ pages

function section(title, ...kids) { return el('section', {}, el('h2', {}, title), kids); }
function table(head, rows, attrs) {
  const body = rows.length ? rows : [el('tr', { class: 'empty' }, el('td', { colspan: String(head.length), class: 'muted' }, 'none'))];
  return el('table', attrs || {}, el('thead', {}, el('tr', {}, head.map((h) => el('th', {}, h)))),
    el('tbody', {}, body));
}
function kv(pairs) {
  return el('dl', { class: 'kv' }, pairs.filter((p) => p[1] !== '' && p[1] !== null && p[1] !== undefined)
    .map(([k, v]) => [el('dt', {}, k), el('dd', {}, v)]));
}

async function pageCluster() {
  const [c, n, j] = await Promise.all([api('/ui/api/cluster'), api('/ui/api/nodes'), api('/ui/api/jobs')]);
  const gpus = n.nodes.flatMap((x) => x.gpus);
  const up = n.nodes.filter((x) => x.state === 'UP').length;
  const tiles = [
    ['Leader', c.leader_id ? 'replica ' + c.leader_id : 'none'],
    ['Term', c.term],
    ['Nodes up', up + ' / ' + n.nodes.length],
    ['GPUs busy', gpus.filter((g) => g.allocated).length + ' / ' + gpus.length],
    ['GPUs quarantined', gpus.filter((g) => !g.healthy).length],
    ['Running jobs', j.jobs.filter((x) => x.state === 'RUNNING').length],
    ['Pending jobs', j.jobs.filter((x) => x.state === 'PENDING').length],
  ];
  const rows = c.replicas.map((r) => el('tr', { class: r.error ? 'bad' : '', dataset: { replica: String(r.id) } },
    el('td', {}, r.id), el('td', {}, r.addr), el('td', {}, badge(r.role)), el('td', {}, r.term),
    el('td', {}, r.applied_index ?? ''), el('td', {}, r.voter ? 'voter' : 'learner'),
    el('td', {}, r.cert_not_after_unix ? when(r.cert_not_after_unix * 1000) : ''),
    el('td', {}, r.error)));
  return [
    el('div', { class: 'tiles', id: 'tiles' }, tiles.map(([k, v]) => el('div', { class: 'tile' },
      el('div', { class: 'tile-v' }, v), el('div', { class: 'tile-k' }, k)))),
    section('Replicas', el('p', { class: 'muted' }, 'Data format ' + c.data_format + '; this page is served by replica ' + c.served_by + '.'),
      table(['Id', 'Address', 'Role', 'Term', 'Applied', 'Vote', 'Certificate until', 'Problem'], rows, { id: 'replicas' })),
  ];
}

function gpuCell(node, g, jobs) {
  const job = g.allocated_to ? jobs.get(g.allocated_to) : null;
  let cls = 'free';
  let text = '';
  let tip = node.name + ' GPU ' + g.index + ' · ' + g.model + ' ' + gib(g.mem_mb) + ' · NVLink island ' + g.nvlink_island;
  if (!g.healthy) { cls = 'bad'; text = '✕'; tip += ' · quarantined: ' + g.health_reason; }
  else if (g.allocated_to) {
    cls = 'busy';
    text = job ? job.display_id : String(g.allocated_to);
    tip += ' · job ' + text + (job ? ' (' + job.user + ': ' + job.name + ')' : '');
  } else if (g.allocated) {
    cls = 'busy hidden';
    text = '·';
    tip += ' · in use by a job you may not see';
  } else if (node.state !== 'UP') { cls = node.state === 'DRAIN' ? 'drain' : 'down'; tip += ' · node ' + node.state.toLowerCase(); }
  const attrs = { class: 'gpu ' + cls, title: tip, dataset: { node: node.name, gpu: String(g.index) } };
  if (g.allocated_to) attrs.dataset.job = String(g.allocated_to);
  if (job) attrs.dataset.user = job.user;
  const cell = el(g.allocated_to ? 'a' : 'span', attrs,
    el('span', { class: 'gi' }, g.index), el('span', { class: 'gj' }, text));
  if (g.allocated_to) cell.setAttribute('href', '#/jobs/' + Number(g.allocated_to));
  return cell;
}

async function pageGpus() {
  const [n, j] = await Promise.all([api('/ui/api/nodes'), api('/ui/api/jobs')]);
  const jobs = new Map(j.jobs.map((x) => [x.id, x]));
  const groups = new Map();
  for (const node of n.nodes) {
    const key = node.topology.length ? node.topology.join(' / ') : 'no topology';
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(node);
  }
  const names = { free: 'free', busy: 'busy (job)', 'busy hidden': "busy (another's job)", bad: 'quarantined', drain: 'drained', down: 'down / powered off' };
  const legend = el('p', { class: 'legend' }, Object.entries(names).map(([c, label]) =>
    el('span', {}, el('span', { class: 'gpu swatch ' + c }), label)));
  const out = [legend];
  for (const [key, nodes] of groups) {
    out.push(el('section', { class: 'group', dataset: { topology: key } }, el('h2', {}, key), nodes.map((node) => {
      const islands = new Map();
      for (const g of node.gpus) {
        if (!islands.has(g.nvlink_island)) islands.set(g.nvlink_island, []);
        islands.get(g.nvlink_island).push(g);
      }
      return el('div', { class: 'node-row', dataset: { node: node.name } },
        el('div', { class: 'node-name' }, node.name, ' ', badge(node.state),
          node.state_reason ? el('span', { class: 'muted small' }, ' ' + node.state_reason) : null,
          el('div', { class: 'muted small' }, node.cpus_alloc + '/' + node.cpus + ' CPUs · ' + gib(node.mem_alloc_mb) + '/' + gib(node.mem_mb))),
        el('div', { class: 'gpus' }, [...islands.values()].map((gs) =>
          el('span', { class: 'island' }, gs.map((g) => gpuCell(node, g, jobs))))),
        node.gpus.length ? null : el('span', { class: 'muted' }, 'no GPUs'));
    })));
  }
  return el('div', { id: 'gpu-map' }, out);
}

function progress(job, now) {
  if (!job.start_time_ms) return '';
  const suspended = job.suspended_ms + (job.suspended_at_ms ? now - job.suspended_at_ms : 0);
  const ran = Math.max(0, now - job.start_time_ms - suspended);
  const limit = job.time_limit_s * 1000;
  const pct = Math.min(100, Math.round((ran / limit) * 100));
  return el('span', { class: 'progress', title: pct + '% of the time limit' },
    el('span', { class: 'bar' }, el('span', { class: 'fill', style: 'width:' + pct + '%' })),
    ' ' + dur(ran) + ' / ' + dur(limit));
}

async function pageQueue() {
  const q = await api('/ui/api/jobs?view=queue');
  const reload = () => render();
  const running = q.jobs.filter((x) => x.state === 'RUNNING' || x.state === 'SUSPENDED');
  const pending = q.jobs.filter((x) => x.state === 'PENDING');
  const gpus = (x) => x.gpus_per_node ? x.nodes * x.gpus_per_node + (x.gpu_type ? ' ' + x.gpu_type : '') : '';
  const row = (x, cells) => el('tr', { dataset: { job: String(x.id), state: x.state } },
    el('td', {}, jobLink(x.id, x.display_id)), el('td', {}, x.name), el('td', {}, x.user), el('td', {}, x.account),
    cells, el('td', {}, actions(x, reload)));
  return [
    section('Running (' + running.length + ')', table(['Job', 'Name', 'User', 'Account', 'State', 'Nodes', 'GPUs', 'Time', ''],
      running.map((x) => row(x, [el('td', {}, badge(x.state)), el('td', {}, x.allocation.map((a) => a.node).join(',')),
        el('td', {}, gpus(x)), el('td', {}, progress(x, q.now_ms))])), { id: 'running' })),
    section('Pending (' + pending.length + ')', table(['Job', 'Name', 'User', 'Account', 'Reason', 'Expected start', 'Nodes', 'GPUs', ''],
      pending.map((x) => {
        const est = q.estimates[String(x.id)];
        return row(x, [el('td', { class: 'reason' }, x.held ? 'held (' + x.held + ')' : x.reason),
          el('td', { class: 'start' }, est && est.start_ms ? when(est.start_ms) : (est ? 'unknown' : '')),
          el('td', {}, x.nodes), el('td', {}, gpus(x))]);
      }), { id: 'pending' }),
    q.more ? el('p', { class: 'muted' }, 'More jobs are queued than this page lists; squeue shows all.') : null),
    section('Recently finished', table(['Job', 'Name', 'User', 'Account', 'State', 'Ended', 'Exit', ''],
      q.finished.map((x) => row(x, [el('td', {}, badge(x.state)), el('td', {}, when(x.end_time_ms)),
        el('td', {}, x.exit_signal ? 'signal ' + x.exit_signal : (x.exit_code ?? ''))])), { id: 'finished' })),
  ];
}

async function pageJob(id, quiet) {
  const [r, h] = await Promise.all([api('/ui/api/jobs/' + Number(id)),
    quiet ? { events: [] } : api('/ui/api/jobs/' + Number(id) + '/events')]);
  const j = r.job;
  const e = r.explanation;
  const reload = () => render();
  const out = [
    el('h1', {}, 'Job ' + j.display_id + ' ', badge(j.state), ' ', actions(j, reload)),
    el('p', { class: 'reason', id: 'job-reason' }, j.reason),
    section('Request', kv([
      ['Name', j.name], ['User', j.user], ['Account', j.account], ['Partition', j.partition], ['QOS', j.qos],
      ['Nodes', j.nodes], ['Tasks per node', j.tasks_per_node], ['CPUs per task', j.cpus_per_task],
      ['GPUs per node', j.gpus_per_node ? j.gpus_per_node + (j.gpu_type ? ' ' + j.gpu_type : '') : ''],
      ['Memory per node', j.mem_per_node_mb ? gib(j.mem_per_node_mb) : ''], ['Time limit', dur(j.time_limit_s * 1000)],
      ['Constraints', j.constraints.join(', ')], ['Dependency', j.dependency],
      ['Command', j.command.join(' ')], ['Working directory', j.workdir], ['Output', j.output], ['Error', j.error],
      ['Submitted', when(j.submit_time_ms)], ['Started', when(j.start_time_ms)], ['Ended', when(j.end_time_ms)],
      ['Held', j.held], ['Exit', j.exit_signal ? 'signal ' + j.exit_signal : (j.exit_code ?? '')],
    ])),
  ];
  if (j.start_time_ms && !j.end_time_ms) out.push(section('Progress', progress(j, r.now_ms)));
  if (j.allocation.length) {
    out.push(section('Placement', table(['Node', 'CPUs', 'Memory', 'GPUs'], j.allocation.map((a) =>
      el('tr', {}, el('td', {}, a.node), el('td', {}, a.cpus), el('td', {}, gib(a.mem_mb)), el('td', {}, a.gpus.join(','))))
    , { id: 'placement' })));
  }
  out.push(section('Attempts', kv([['Attempt', j.attempt], ['Preempted', j.preempted], ['Ran on', j.ran_on.join(', ')]])));
  if (j.steps.length) {
    out.push(section('Steps', table(['Step', 'Name', 'Tasks', 'State', 'Started', 'Ended', 'Exit'], j.steps.map((s) =>
      el('tr', {}, el('td', {}, s.id), el('td', {}, s.name), el('td', {}, s.tasks), el('td', {}, badge(s.state)),
        el('td', {}, when(s.start_ms)), el('td', {}, when(s.end_ms)), el('td', {}, s.signal ? 'signal ' + s.signal : (s.exit_code ?? '')))))));
  }
  if (e) {
    if (e.error) out.push(section('Why pending', el('p', { class: 'bad' }, e.error)));
    else {
      const rej = Object.entries(e.rejections || {}).sort((a, b) => b[1] - a[1]);
      out.push(el('section', { id: 'why-pending' }, el('h2', {}, 'Why pending'), kv([
        ['Reason', e.reason], ['Detail', e.detail], ['Queue position', e.queue_position],
        ['Eligible nodes', e.eligible_nodes], ['Expected start', e.estimated_start_ms ? when(e.estimated_start_ms) : 'unknown'],
        ['Would start on', (e.start_nodes || []).join(', ')], ['Priority', e.priority ? e.priority.toFixed(1) : ''],
      ]), rej.length ? table(['Nodes rejected because', 'Count'], rej.map(([k, v]) =>
        el('tr', {}, el('td', {}, k), el('td', {}, v))), { id: 'rejections' }) : null));
    }
  }
  // A quiet redraw keeps the list on the page (render); a first one fills it
  // from what the replica kept, and the live stream adds to it.
  out.push(section('Events', el('ol', { class: 'feed', id: 'job-events', dataset: { through: String(h.through || 0) } }, h.events.map(eventItem))));
  return out;
}

async function pageAccounts() {
  const a = await api('/ui/api/accounts');
  return section('Accounts and fair share', table(['Account', 'Parent', 'Shares', 'GPU-hours (decayed)', 'CPU-hours', 'Usage', 'Fair-share factor', 'Running GPUs', 'Running', 'Pending'],
    a.accounts.map((x) => el('tr', { dataset: { account: x.account } }, el('td', {}, x.account), el('td', {}, x.parent), el('td', {}, x.shares),
      el('td', {}, x.gpu_hours.toFixed(2)), el('td', {}, x.cpu_hours.toFixed(2)), el('td', {}, (x.norm_usage * 100).toFixed(1) + '%'),
      el('td', {}, el('span', { class: 'bar' }, el('span', { class: 'fill', style: 'width:' + Math.round(x.factor * 100) + '%' })), ' ' + x.factor.toFixed(3)),
      el('td', {}, x.running_gpus), el('td', {}, x.running_jobs), el('td', {}, x.pending_jobs))), { id: 'accounts' }));
}

function eventItem(ev) {
  return el('li', { dataset: { kind: ev.kind, job: String(ev.job_id) } },
    el('span', { class: 'muted' }, (ev.time_ms ? new Date(ev.time_ms).toLocaleTimeString() + ' ' : '') + '#' + ev.index + ' '),
    ev.job_id ? [jobLink(ev.job_id, 'job ' + ev.job_id), ' '] : null,
    el('b', {}, ev.kind.replace(/_/g, ' ')), ' ',
    ev.state && ev.state !== 'UNKNOWN' ? badge(ev.state) : null,
    ev.node ? ' on ' + ev.node + (ev.gpu !== null && ev.gpu !== undefined ? ' GPU ' + ev.gpu : '') : '',
    ev.reason ? el('span', { class: 'muted' }, ' ' + ev.reason) : null);
}

async function pageEvents() {
  return section('Live events', el('p', { class: 'muted' }, 'The newest first; the last ' + FEED_MAX + ' since this page was opened.'),
    el('ol', { class: 'feed', id: 'feed' }, state.feed.slice().reverse().map(eventItem)));
}

// ------------------------------------------------------------------ live

function openStream() {
  if (state.stream || !state.me) return;
  const live = document.getElementById('live');
  const es = new EventSource('/ui/api/events');
  state.stream = es;
  es.onopen = () => { live.className = 'live on'; };
  es.onmessage = (m) => {
    let ev;
    try { ev = JSON.parse(m.data); } catch (_) { return; }
    state.feed.push(ev);
    if (state.feed.length > FEED_MAX) state.feed.shift();
    const feed = document.getElementById('feed');
    if (feed) feed.prepend(eventItem(ev));
    if (state.page === 'job') {
      if (ev.job_id !== state.jobId) return;
      const list = document.getElementById('job-events');
      if (list) list.append(eventItem(ev));
      // Still loading: kept until the page shows its history.
      else if (state.jobPending.length < JOB_PENDING_MAX) state.jobPending.push(ev);
    }
    if (state.page !== 'events') scheduleRefresh();
  };
  es.onerror = () => {
    live.className = 'live off';
    // Refused (too many streams) or the replica went away: poll until it is back.
    if (es.readyState === EventSource.CLOSED) {
      state.stream = null;
      setTimeout(openStream, POLL_MS);
      scheduleRefresh();
    }
  };
}

function scheduleRefresh() {
  if (state.timer) return;
  state.timer = setTimeout(() => { state.timer = null; render(true); }, REFRESH_DEBOUNCE_MS);
}

// ------------------------------------------------------------------ shell

function showLogin(body) {
  // Logged out or expired: nothing may keep reloading under the form.
  if (state.stream) { state.stream.close(); state.stream = null; }
  clearTimeout(state.timer);
  state.timer = null;
  state.me = null;
  const main = document.getElementById('main');
  const insecure = body && body.login === 'user';
  const input = insecure
    ? el('input', { id: 'login-user', name: 'user', autocomplete: 'username', placeholder: 'user name', required: 'required' })
    : el('textarea', { id: 'login-token', name: 'token', rows: '4', placeholder: 'a bearer token: gangway token create --user NAME', required: 'required' });
  const msg = el('p', { class: 'bad', id: 'login-error' });
  const form = el('form', { id: 'login', onsubmit: async (ev) => {
    ev.preventDefault();
    try {
      await api('/ui/login', { method: 'POST', body: insecure ? { user: input.value } : { token: input.value }, noLogin: true });
      await start();
    } catch (e) { msg.textContent = e.message; }
  } }, el('h1', {}, 'Log in to Gangway'), el('p', { class: 'muted' }, body && body.error ? body.error : ''), input, el('button', { type: 'submit' }, 'Log in'), msg);
  main.replaceChildren(form);
  document.getElementById('me').replaceChildren();
}

async function render(quiet) {
  if (state.refreshing) { if (quiet) scheduleRefresh(); return; }
  state.refreshing = true;
  const hash = location.hash || '#/';
  const m = hash.match(/^#\/jobs\/(\d+)$/);
  const page = m ? 'job' : ({ '#/': 'cluster', '#/gpus': 'gpus', '#/queue': 'queue', '#/accounts': 'accounts', '#/events': 'events' }[hash] || 'cluster');
  const jobId = m ? Number(m[1]) : null;
  // A redraw from events keeps the job page's event list.
  quiet = quiet && page === state.page && jobId === state.jobId;
  if (!quiet) state.jobPending = [];
  state.page = page;
  state.jobId = jobId;
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('here', a.dataset.page === page);
  const main = document.getElementById('main');
  try {
    const content = await ({ cluster: pageCluster, gpus: pageGpus, queue: pageQueue, accounts: pageAccounts, events: pageEvents }[page] || (() => pageJob(jobId, quiet)))();
    // A redraw of the job page keeps its event list (and its stream).
    const keep = page === 'job' && quiet ? document.getElementById('job-events') : null;
    main.replaceChildren(...[content].flat());
    if (keep) { const fresh = document.getElementById('job-events'); if (fresh) fresh.replaceWith(keep); }
    // Live events that came while the history loaded, after what it holds.
    const list = document.getElementById('job-events');
    if (list) {
      const through = Number(list.dataset.through || 0);
      for (const ev of state.jobPending) if (ev.index > through) list.append(eventItem(ev));
      state.jobPending = [];
    }
    main.dataset.page = page;
    main.dataset.loaded = String(Date.now());
  } catch (e) {
    if (!(e instanceof LoginNeeded)) main.replaceChildren(el('p', { class: 'bad', id: 'page-error' }, e.message));
  } finally {
    state.refreshing = false;
  }
}

async function start() {
  // Another login in this tab: the old user's stream and feed go.
  if (state.stream) { state.stream.close(); state.stream = null; }
  state.feed = [];
  state.me = await api('/ui/api/whoami');
  document.getElementById('me').replaceChildren(
    el('span', { id: 'whoami' }, state.me.user + (state.me.admin ? ' (admin)' : state.me.operator ? ' (operator)' : '')),
    state.me.certificate ? null : el('button', { class: 'link', onclick: async () => {
      await api('/ui/logout', { method: 'POST', noLogin: true }).catch(() => {});
      location.hash = '#/';
      location.reload();
    } }, 'Log out'));
  openStream();
  await render();
}

// A login link (`gangway dev` prints one) carries the token in the fragment,
// which never reaches a server or a log: trade it for the session cookie.
async function loginFromLink() {
  const t = location.hash.match(/^#token=([A-Za-z0-9._-]+)$/);
  if (!t) return false;
  history.replaceState(null, '', location.pathname + '#/');
  // A link never logs this browser in, nor switches who it is, without
  // asking: in a fresh tab too, where the page learns first whom the
  // browser's session (or certificate) already is.
  let current = state.me;
  if (!current) {
    try { current = await api('/ui/api/whoami', { noLogin: true }); } catch (_) { current = null; }
  }
  const question = 'The link you opened logs this browser in as ' + linkUser(t[1]) +
    (current ? ', instead of as ' + current.user : '') + '. Go on?';
  if (!window.confirm(question)) return false;
  try { await api('/ui/login', { method: 'POST', body: { token: t[1] }, noLogin: true }); } catch (e) { toast(e.message, true); }
  return true;
}

// The user a link's token names (its `sub`), for the question only: the
// server verifies the token itself.
function linkUser(token) {
  try {
    const part = token.split('.')[1].replace(/-/g, '+').replace(/_/g, '/');
    const sub = JSON.parse(atob(part)).sub;
    return typeof sub === 'string' && /^[A-Za-z0-9._@-]{1,128}$/.test(sub) ? sub : 'the user its token names';
  } catch (_) {
    return 'the user its token names';
  }
}

async function boot() {
  await loginFromLink();
  try { await start(); } catch (e) { if (!(e instanceof LoginNeeded)) document.getElementById('main').replaceChildren(el('p', { class: 'bad' }, e.message)); }
}

window.addEventListener('hashchange', async () => {
  if (await loginFromLink()) { await boot(); return; }
  if (state.me) render();
});
window.addEventListener('DOMContentLoaded', boot);
