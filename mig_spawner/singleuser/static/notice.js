// mig-spawner: the slice service's warning before it stops this server, as a
// JupyterLab 4 notification with a "Keep my server" button; and the report that a
// person is using this page (typing, clicks, scrolling), which is what keeps the
// server from being stopped as idle. Plain script, no build.
(function () {
  "use strict";
  const me = document.getElementById("mig-spawner-notice");
  const base = me.dataset.baseUrl;
  const pollSeconds = Number(me.dataset.poll) || 15;
  let shown = null; // {id, key} of the notification on screen
  // Opening the page is a person's doing: the first report goes at load.
  let interacted = true;
  let reported = 0; // when the last report went (ms)

  async function report() {
    if (!interacted) return;
    interacted = false;
    reported = Date.now();
    try {
      await fetch(base + "mig-spawner/activity", {
        method: "POST", headers: {"X-XSRFToken": xsrf()}, body: "",
      });
    } catch (e) {
      interacted = true; // the server restarting: report at the next look
    }
  }

  function touched() {
    interacted = true;
    // At once when the last report is a look old (a warned user coming back counts
    // before the stop), else with the next look: at most one report per look.
    if (Date.now() - reported >= pollSeconds * 1000) report();
  }
  for (const kind of ["keydown", "pointerdown", "wheel"]) {
    window.addEventListener(kind, touched, {capture: true, passive: true});
  }

  function xsrf() {
    const m = document.cookie.match(/(?:^|;\s*)_xsrf=([^;]*)/);
    return m ? decodeURIComponent(m[1]) : "";
  }

  function app() {
    return window.jupyterapp;
  }

  async function keep() {
    const r = await fetch(base + "mig-spawner/keep", {
      method: "POST", headers: {"X-XSRFToken": xsrf(), "Content-Type": "application/json"},
      body: "{}",
    });
    const answer = r.ok ? await r.json() : {outcome: "error", message: "The hub could not keep it; try again."};
    // JupyterLab closes a notification when one of its buttons is pressed: answer in
    // a new one, which stays until the user closes it.
    await app().commands.execute("apputils:notify", {
      message: answer.message,
      type: answer.outcome === "refused" || answer.outcome === "error" ? "error" : "success",
      options: {autoClose: false},
    });
    if (shown) shown.key = "answered:" + shown.key;
  }

  async function poll() {
    report();
    const lab = app();
    if (!lab) return;
    if (!lab.commands.hasCommand("mig-spawner:keep")) {
      lab.commands.addCommand("mig-spawner:keep", {label: "Keep my server", execute: keep});
    }
    let warning = null;
    try {
      const r = await fetch(base + "mig-spawner/warning", {headers: {"X-XSRFToken": xsrf()}});
      if (!r.ok) return;
      warning = (await r.json()).warning;
    } catch (e) {
      return; // the server or hub restarting: try again at the next poll
    }
    if (!warning) {
      if (shown && !shown.key.startsWith("answered:")) {
        lab.commands.execute("apputils:dismiss-notification", {id: shown.id});
        shown = null;
      }
      return;
    }
    const key = warning.reason + "@" + warning.deadline;
    if (shown && shown.key === "answered:" + key) return;
    // "Keep my server" only where it can do something (a re-cut cannot be put off).
    const actions = warning.keep ? [
      {label: "Keep my server", commandId: "mig-spawner:keep", displayType: "accent"},
    ] : [];
    if (shown && shown.key === key) {
      // The same warning: keep its time left true.
      lab.commands.execute("apputils:update-notification", {
        id: shown.id, message: warning.message, type: "warning", autoClose: false, actions,
      });
      return;
    }
    if (shown && !shown.key.startsWith("answered:")) {
      lab.commands.execute("apputils:dismiss-notification", {id: shown.id});
    }
    const id = await lab.commands.execute("apputils:notify", {
      message: warning.message, type: "warning", options: {autoClose: false, actions},
    });
    shown = {id, key};
  }

  setInterval(poll, pollSeconds * 1000);
  setTimeout(poll, 1000);
})();
