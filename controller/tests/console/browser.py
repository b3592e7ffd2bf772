#!/usr/bin/env python3
"""The console in a real browser: headless Chromium driven over the DevTools
protocol through a pipe (--remote-debugging-pipe: no port, no library),
against a running dev cluster that check.sh started and filled with jobs.

Every check reads the page the way a person would (what the DOM shows after
the page's own script ran) and compares it with what the CLI says, then the
page's own buttons change the cluster. Screenshots of each page go to the
directory given.

  browser.py CONFIG.json
"""
import base64
import json
import os
import subprocess
import sys
import tempfile
import time

# A page's data arrives within this (it reloads on every event, at most once a second).
WAIT_S = 30
# Commands sent to the browser that get no answer within this fail the test.
COMMAND_TIMEOUT_S = 60


class Failed(Exception):
    pass


class Browser:
    """One headless Chromium and one page, spoken to over CDP on fds 3 and 4."""

    def __init__(self, chromium, profile):
        to_chrome_r, self.to_chrome = os.pipe()
        self.from_chrome, from_chrome_w = os.pipe()
        flags = [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--remote-debugging-pipe", "--user-data-dir=" + profile, "--no-first-run",
            "--no-default-browser-check", "--disable-extensions", "--window-size=1400,1000",
            "--disable-background-networking", "--disable-component-update", "--hide-scrollbars",
        ]
        cmd = 'exec "$0" "$@" 3<&%d 4>&%d' % (to_chrome_r, from_chrome_w)
        self.proc = subprocess.Popen(
            ["bash", "-c", cmd, chromium] + flags, pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(profile, "chromium.log"), "wb"))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.buf = b""
        self.next_id = 0
        self.dialogs = []
        # Whether the page's confirm() dialogs are accepted (as a person who
        # agrees would) or dismissed.
        self.accept_dialogs = True
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.errors = []
        self.send("Page.enable", session=self.session)
        self.send("Runtime.enable", session=self.session)
        self.send("Log.enable", session=self.session)

    def _write(self, msg):
        data = json.dumps(msg).encode() + b"\0"
        while data:
            n = os.write(self.to_chrome, data)
            data = data[n:]

    def _read(self, deadline):
        while b"\0" not in self.buf:
            if time.time() > deadline:
                raise Failed("the browser did not answer within %d s" % COMMAND_TIMEOUT_S)
            chunk = os.read(self.from_chrome, 1 << 20)
            if not chunk:
                raise Failed("the browser exited (see chromium.log in its profile)")
            self.buf += chunk
        msg, _, self.buf = self.buf.partition(b"\0")
        return json.loads(msg)

    def send(self, method, params=None, session=None):
        self.next_id += 1
        mid = self.next_id
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._write(msg)
        deadline = time.time() + COMMAND_TIMEOUT_S
        while True:
            m = self._read(deadline)
            if m.get("method") == "Page.javascriptDialogOpening":
                # A confirm() from the page (cancel asks first): accept it, as a person would.
                self.dialogs.append(m["params"]["message"])
                self.next_id += 1
                self._write({"id": self.next_id, "method": "Page.handleJavaScriptDialog",
                             "params": {"accept": self.accept_dialogs}, "sessionId": m.get("sessionId")})
                continue
            if m.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(m["params"]["exceptionDetails"])[:500])
            if m.get("method") == "Log.entryAdded" and m["params"]["entry"].get("level") == "error":
                # Content-Security-Policy violations land here; failed
                # requests the test makes on purpose (401, 403) too.
                e = m["params"]["entry"]
                if e.get("source") != "network":
                    self.errors.append(e.get("text", "")[:500])
            if m.get("id") == mid:
                if "error" in m:
                    raise Failed("%s: %s" % (method, m["error"]))
                return m["result"]

    def eval(self, expr):
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                      session=self.session)
        if "exceptionDetails" in r:
            raise Failed("in the page: %s: %s" % (expr, r["exceptionDetails"]))
        return r["result"].get("value")

    def go(self, url):
        self.send("Page.navigate", {"url": url}, session=self.session)

    def wait(self, what, expr, timeout=WAIT_S):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                last = self.eval(expr)
                if last:
                    return last
            except Failed as e:
                last = str(e)
            time.sleep(0.2)
        raise Failed("%s (waited %d s; last: %r)" % (what, timeout, last))

    def page(self, hash_, name):
        """Goes to a page of the console and waits for its data."""
        self.eval("location.hash = %s" % json.dumps(hash_))
        self.wait("the %s page loaded" % name,
                  "document.querySelector('#main').dataset.page === %s && !!document.querySelector('#main').dataset.loaded"
                  % json.dumps(name))

    def screenshot(self, path):
        h = self.eval("Math.max(document.body.scrollHeight, 600)")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": 1400, "height": min(int(h), 4000), "deviceScaleFactor": 1, "mobile": False},
                  session=self.session)
        time.sleep(0.3)
        shot = self.send("Page.captureScreenshot", {"format": "png"}, session=self.session)
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))
        self.send("Emulation.clearDeviceMetricsOverride", session=self.session)

    def close(self):
        try:
            self.send("Browser.close")
        except Failed:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main():
    cfg = json.load(open(sys.argv[1]))
    env = dict(os.environ, GANGWAY_ENDPOINTS=cfg["endpoints"])
    shots = cfg["screenshots"]
    os.makedirs(shots, exist_ok=True)

    def cli(*args):
        return subprocess.run([cfg["gangway"], *args], env=env, capture_output=True, text=True, timeout=60, check=True).stdout

    def state_of(job):
        return json.loads(cli("show", job, "--json"))["state"]

    def eventually(what, f, timeout=WAIT_S):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if f():
                return
            time.sleep(0.3)
        raise Failed(what)

    checks = []

    def check(name, ok, detail=""):
        if not ok:
            raise Failed("%s: %s" % (name, detail))
        checks.append(name)
        print("ok   " + name, flush=True)

    jobs = cfg["jobs"]
    train, big, odd = jobs["train"], jobs["big"], jobs["odd"]
    profile = tempfile.mkdtemp(prefix="gangway-console-browser-")
    b = Browser(cfg["chromium"], profile)
    try:
        # The login link gangway dev prints: the token rides in the fragment.
        b.go(cfg["login_url"])
        b.wait("the cluster page after the login link", "document.querySelector('#main').dataset.page === 'cluster'")
        check("the login link logs in as the dev cluster's admin",
              b.eval("document.querySelector('#whoami').textContent") == cfg["admin"] + " (admin)",
              b.eval("document.querySelector('#whoami') && document.querySelector('#whoami').textContent"))
        check("the token left the address bar", "token" not in b.eval("location.href"), b.eval("location.href"))
        check("the login link asked first, naming whom it logs in as",
              any("logs this browser in as " + cfg["admin"] in d for d in b.dialogs), b.dialogs)
        replicas = b.eval("document.querySelectorAll('#replicas tbody tr').length")
        leaders = b.eval("[...document.querySelectorAll('#replicas .badge')].filter(x => x.textContent === 'leader').length")
        check("the cluster page lists 3 replicas and one leader", replicas == 3 and leaders == 1, (replicas, leaders))
        b.screenshot(os.path.join(shots, "cluster.png"))

        b.page("#/gpus", "gpus")
        cells = b.wait("job %s on the GPU map" % train,
                       "(() => { const c = [...document.querySelectorAll('.gpu[data-job=\"%s\"]')];"
                       " return c.length ? c.map(x => x.dataset.node + ':' + x.dataset.gpu) : null })()" % train)
        placed = json.loads(cli("show", train, "--json"))["allocation"]
        expect = sorted("%s:%d" % (a["node"], g) for a in placed for g in a["gpus"])
        check("the GPU map shows the running job on exactly its GPUs", sorted(cells) == expect, (cells, expect))
        bad = b.wait("the quarantined GPU on the map",
                     "(() => { const c = document.querySelector('.gpu.bad[data-node=\"%s\"][data-gpu=\"%s\"]');"
                     " return c ? c.title : null })()" % (cfg["fault_node"], cfg["fault_gpu"]))
        check("the GPU map shows the quarantined GPU with its reason", "quarantined" in bad and "xid" in bad.lower(), bad)
        b.screenshot(os.path.join(shots, "gpus.png"))

        b.page("#/queue", "queue")
        want = cli("squeue", "-h", "-j", big, "-o", "%r").strip()
        shown = b.wait("job %s pending with a reason" % big,
                       "(() => { const r = document.querySelector('#pending tr[data-job=\"%s\"] .reason');"
                       " return r && r.textContent })()" % big)
        check("a pending job shows the reason squeue gives", shown == want, (shown, want))
        start = b.eval("document.querySelector('#pending tr[data-job=\"%s\"] .start').textContent" % big)
        check("a pending job shows its expected start", start != "", start)
        name = b.eval("document.querySelector('#running tr[data-job=\"%s\"] td:nth-child(2)').textContent" % odd)
        check("a job name full of markup shows as text", name == cfg["odd_name"], name)
        check("no markup from a job ran", b.eval("document.querySelectorAll('#main img').length === 0 && window.__xss === undefined"))
        b.screenshot(os.path.join(shots, "queue.png"))

        b.page("#/jobs/" + big, "job")
        rejections = b.wait("why-pending with node rejections",
                            "document.querySelectorAll('#why-pending #rejections tbody tr').length")
        check("the job page says why it waits, with node rejection counts", rejections >= 1, rejections)
        b.screenshot(os.path.join(shots, "job.png"))

        # Cancel from the page: the button, its confirmation, the cluster.
        b.page("#/queue", "queue")
        b.eval("document.querySelector('button[data-action=\"cancel\"][data-job=\"%s\"]').click()" % train)
        eventually("job %s was not cancelled by the page's button" % train, lambda: state_of(train) == "CANCELLED")
        check("a cancel from the page cancels the job (after its confirmation)",
              any(train in d for d in b.dialogs), b.dialogs)
        b.page("#/gpus", "gpus")
        b.wait("the GPU map to free the cancelled job's GPUs",
               "document.querySelector('#main').dataset.page === 'gpus' && "
               "document.querySelectorAll('.gpu[data-job=\"%s\"]').length === 0" % train)
        check("the GPU map frees the cancelled job's GPUs live", True)

        b.page("#/jobs/" + train, "job")
        hist = b.wait("the cancelled job's events on its page",
                      "(() => { const t = (document.querySelector('#job-events') || {}).textContent || '';"
                      " return t.includes('CANCELLED') ? t : null })()")
        check("a job's page lists its events, from submission to cancel", "submitted" in hist, hist)

        b.page("#/events", "events")
        ev = b.wait("the cancel in the live feed",
                    "[...document.querySelectorAll('#feed li[data-job=\"%s\"]')].map(x => x.textContent).join('|')" % train)
        check("the live event feed shows the cancel", "CANCELLED" in ev, ev)
        b.screenshot(os.path.join(shots, "events.png"))

        b.page("#/accounts", "accounts")
        rows = b.eval("document.querySelectorAll('#accounts tbody tr').length")
        check("the accounts page shows fair share", rows >= 1, rows)
        b.screenshot(os.path.join(shots, "accounts.png"))

        # A write without the page's header is refused (another site's form).
        status = b.eval("fetch('/ui/api/jobs/%s/hold', {method: 'POST'}).then(r => r.status)" % big)
        check("a write without the console's header is refused", status == 403, status)

        # Another user, with private jobs: sees only what the rules let them see.
        b.eval("document.querySelector('#me button').click()")
        b.wait("the logout", "!!document.querySelector('#login')")
        b.go(cfg["other_login_url"])
        b.wait("the other user's cluster page", "document.querySelector('#main').dataset.page === 'cluster'")
        who = b.eval("document.querySelector('#whoami').textContent")
        check("another user logs in with their own token", who == cfg["other"], who)
        # The admin's link opened in a fresh page while logged in as the
        # other user: it asks, naming both; dismissed, nothing changes.
        asked = len(b.dialogs)
        b.accept_dialogs = False
        b.go("about:blank")  # a fresh page: it knows nobody until it asks the server
        b.wait("a blank page", "location.href === 'about:blank'")
        b.go(cfg["login_url"])
        b.wait("the page after a dismissed login link", "document.querySelector('#main').dataset.page === 'cluster'")
        b.accept_dialogs = True
        question = b.dialogs[asked:]
        check("a link in a fresh page asks before switching who the browser is",
              any(cfg["admin"] in d and "instead of as " + cfg["other"] in d for d in question), question)
        who = b.eval("document.querySelector('#whoami').textContent")
        check("and, dismissed, the browser is still the other user", who == cfg["other"], who)
        b.page("#/queue", "queue")
        seen = b.eval("document.querySelectorAll('tr[data-job]').length")
        check("with private jobs another user sees none of the admin's jobs", seen == 0, seen)
        b.page("#/gpus", "gpus")
        named = b.eval("document.querySelectorAll('.gpu[data-job]').length")
        hidden = b.eval("document.querySelectorAll('.gpu.busy.hidden').length")
        check("the GPU map shows others' GPUs as busy without naming their jobs", named == 0 and hidden >= 1, (named, hidden))
        b.screenshot(os.path.join(shots, "gpus-other-user.png"))
        b.eval("location.hash = '#/jobs/%s'" % odd)
        err = b.wait("the other user's view of the admin's job", "(document.querySelector('#page-error') || {}).textContent")
        check("another user cannot open the admin's job", "not" in err.lower(), err)
        status = b.eval("fetch('/ui/api/jobs/%s/cancel', {method: 'POST', headers: {'x-gangway-csrf': '1'}}).then(r => r.status)" % odd)
        check("another user's forged cancel is refused", status in (403, 404), status)
        check("and the job still runs", state_of(odd) == "RUNNING", state_of(odd))
        b.eval("1")  # collects what the page logged last
        check("no script error and no Content-Security-Policy violation in any page", not b.errors, b.errors)
    finally:
        b.close()
    print("console browser checks: %d passed; screenshots in %s" % (len(checks), shots))


if __name__ == "__main__":
    try:
        main()
    except Failed as e:
        print("FAIL " + str(e), file=sys.stderr)
        sys.exit(1)
