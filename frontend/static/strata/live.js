// The live stream: load the REST snapshot, then apply the websocket's batches of events in sequence
// order. A batch that is incomplete (the channel layer dropped something) or that does not follow
// the last sequence number applied means a gap: reload the snapshot. Reconnect with backoff.
(function () {
  "use strict";
  const PING_EVERY_MS = 20000;
  const BACKOFF_FIRST_MS = 500;
  const BACKOFF_MAX_MS = 10000;

  function live(handlers) {
    const stateEl = document.getElementById("stream-state");
    const seqEl = document.getElementById("last-seq");
    const stream = { state: "connecting", lastSeq: 0, resyncs: 0, frames: 0 };
    let backoff = BACKOFF_FIRST_MS;
    let syncing = null;
    let held = [];
    let socket = null;
    let pinger = null;

    function show(state, text) {
      stream.state = state;
      document.body.dataset.streamState = state;
      if (stateEl) {
        stateEl.textContent = text || state;
        stateEl.className = state === "live" ? "stream-live" : "";
      }
    }

    function showSeq() {
      document.body.dataset.lastSeq = String(stream.lastSeq);
      if (seqEl) seqEl.textContent = "#" + stream.lastSeq;
    }

    async function resync(reason) {
      if (syncing) return syncing;
      stream.resyncs += 1;
      show("syncing", "loading snapshot" + (reason ? " (" + reason + ")" : ""));
      syncing = (async () => {
        try {
          const seq = await handlers.snapshot();
          stream.lastSeq = Number(seq) || 0;
          showSeq();
          show("live", "live");
        } catch (err) {
          show("error", "snapshot failed: " + err.message + "; retrying");
          setTimeout(() => resync("retry"), 2000);
        } finally {
          syncing = null;
        }
        const frames = held;
        held = [];
        frames.forEach(applyFrame);
      })();
      return syncing;
    }

    function applyFrame(frame) {
      if (syncing) { held.push(frame); return; }
      stream.frames += 1;
      if (!frame.complete) { resync(frame.reason || "events were dropped"); return; }
      if (frame.first > stream.lastSeq + 1) { resync("missed events " + (stream.lastSeq + 1) + "–" + (frame.first - 1)); return; }
      let applied = 0;
      (frame.events || []).forEach((event) => {
        if (typeof event.seq !== "number" || event.seq <= stream.lastSeq) return;
        try { handlers.apply(event); applied += 1; } catch (err) { console.error("event not applied", event, err); }
      });
      stream.lastSeq = Math.max(stream.lastSeq, frame.last);
      showSeq();
      if (applied && handlers.afterBatch) handlers.afterBatch();
    }

    function connect() {
      const scheme = location.protocol === "https:" ? "wss://" : "ws://";
      socket = new WebSocket(scheme + location.host + "/ws/dashboard/");
      show("connecting", "connecting…");
      socket.onmessage = (message) => {
        let frame;
        try { frame = JSON.parse(message.data); } catch (err) { return; }
        if (frame.type === "hello") {
          backoff = BACKOFF_FIRST_MS;
          resync("connected");
        } else if (frame.type === "batch") {
          applyFrame(frame);
        } else if (frame.type === "error") {
          console.warn("dashboard stream:", frame.error);
        }
      };
      socket.onopen = () => {
        clearInterval(pinger);
        pinger = setInterval(() => { if (socket.readyState === WebSocket.OPEN) socket.send('{"type":"ping"}'); }, PING_EVERY_MS);
      };
      socket.onclose = (closed) => {
        clearInterval(pinger);
        if (closed.code === 4401 || closed.code === 4403) {
          show("closed", "not allowed (" + closed.code + "); log in again");
          return;
        }
        const wait = backoff + Math.random() * 250;
        show("reconnecting", "reconnecting in " + (wait / 1000).toFixed(1) + " s");
        setTimeout(connect, wait);
        backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
      };
    }

    stream.resync = resync;
    stream.close = () => socket && socket.close();
    window.Strata.stream = stream;
    connect();
    return stream;
  }

  window.Strata = Object.assign(window.Strata || {}, { live });
})();
