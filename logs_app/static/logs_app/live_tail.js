// The live tail of an attempt's log page (logs_app/admin.py): follows the logs API
// (GET /api/v1/runs/<run>/logs/?attempt=N&after=<line>&follow=true, a long poll, with the
// browser's session) and appends each page's lines; once the attempt has ended, reads the
// run (GET /api/v1/runs/<run>/) for its final state and error. No library, no CDN.
(function () {
  "use strict";

  const WAIT_SECONDS = 10; // each long poll waits at most this long on the server
  const RETRY_MS = 2000; // after a failed request

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  async function getJson(url) {
    const response = await fetch(url, {
      credentials: "same-origin",
      headers: { Accept: "application/json" },
    });
    if (!response.ok) {
      const error = new Error("HTTP " + response.status);
      // Refused for good (not this user's to read through the API, or gone): no retry.
      error.final = [401, 403, 404].includes(response.status);
      throw error;
    }
    return response.json();
  }

  function start(view) {
    const lines = document.getElementById("log-lines");
    const status = document.getElementById("log-status");
    const state = document.getElementById("attempt-state");
    const empty = document.getElementById("log-empty");
    const maxLines = Number(view.dataset.maxLines);
    let after = Number(view.dataset.after);
    let shown = lines.textContent ? lines.textContent.split("\n").length - 1 : 0;

    function append(page) {
      if (!page.lines.length) {
        return;
      }
      const atBottom = lines.scrollTop + lines.clientHeight >= lines.scrollHeight - 4;
      const text = page.lines
        .map((l) => [l.n, l.ts, l.stream, l.level, l.text].join(" ") + "\n")
        .join("");
      lines.appendChild(document.createTextNode(text));
      shown += page.lines.length;
      // Bounded: the oldest lines leave the page (the text link keeps them all).
      while (shown > maxLines && lines.firstChild) {
        shown -= lines.firstChild.textContent.split("\n").length - 1;
        lines.removeChild(lines.firstChild);
      }
      after = page.lines[page.lines.length - 1].n;
      if (empty) {
        empty.hidden = true;
      }
      if (atBottom) {
        lines.scrollTop = lines.scrollHeight;
      }
    }

    async function finish() {
      const run = await getJson(view.dataset.runUrl);
      const attempt = run.attempts.find((a) => a.number === Number(view.dataset.attempt));
      if (attempt && attempt.error) {
        const box = document.getElementById("log-error");
        box.textContent = attempt.error;
        box.hidden = false;
        document.getElementById("log-no-error").hidden = true;
      } else {
        document.getElementById("log-no-error").textContent = "None.";
      }
    }

    async function follow() {
      for (;;) {
        let page;
        try {
          page = await getJson(
            view.dataset.logsUrl + "&after=" + after + "&follow=true&wait=" + WAIT_SECONDS
          );
        } catch (error) {
          if (error.final) {
            status.textContent = "No live tail (" + error.message + "): the logs API does not " +
              "show this run to you; reload the page for the lines stored since.";
            view.dataset.follow = "refused";
            return;
          }
          status.textContent = "Live tail interrupted (" + error.message + "); trying again.";
          await sleep(RETRY_MS);
          continue;
        }
        append(page);
        state.textContent = page.attempt_state;
        state.className = "state state-" + page.attempt_state;
        if (page.ended) {
          status.textContent = page.complete
            ? "Complete: the attempt has ended and every line is here."
            : "Ended without its manifest: lines after the last one shipped are lost.";
          view.dataset.follow = "ended";
          await finish();
          return;
        }
        status.textContent = "Live: " + shown + " lines, following.";
      }
    }

    follow();
  }

  document.addEventListener("DOMContentLoaded", function () {
    const view = document.getElementById("log-view");
    if (view && view.dataset.follow === "true") {
      start(view);
    }
  });
})();
